"""The ``autoprec`` command: search, profile, best, resolve, report, compare, ui, export.

Bad input of any kind ends with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from autoprec.errors import AutoprecError, redact
from autoprec.exports.registry import FORMATS
from autoprec.settings import (
    SECTIONS,
    Option,
    check_study_name,
    declared,
    options,
    read_file,
    to_yaml,
)
from autoprec.trials import MODES, Mode, mode_named

STARTED_S = time.perf_counter()  # the command's start, for the search's closing line

if TYPE_CHECKING:
    from autoprec.policy import Policy
    from autoprec.study.summary_schema import Summary

EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None (those options say in words what they default to) and
    a switch's."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="autoprec",
        description="Find the per-layer precision policy that trains as well as fp32 "
        "(fp32/fp16/bf16/fp8 and loss scaling) or serves as accurately as fp32 (fp32/fp16/"
        "bf16/int8/fp8, --mode serving) with the least time or memory. fp8 runs where the "
        "device has its kernels (CUDA 8.9+), on the CPU only emulated (--emulate fp8).",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {_version()}", help="print the version"
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_search(commands)
    _add_other_commands(commands)
    _add_export(commands)
    return parser


def _version() -> str:
    """The installed package's version, as pip knows it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("autoprec")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _add_export(commands: Any) -> None:
    e = commands.add_parser(
        "export",
        help="write a study's best policy in a format other tools read (a served model, "
        "torchao, ATC, torch_npu, transformers, fp8 for torchtitan/torchao/accelerate, "
        "optimizer states for torchao, bitsandbytes and the Trainer)",
        description="Export the best policy of a finished search in one of the formats "
        "--format lists. Where a format cannot say exactly what the policy says, a note on "
        "stderr says what it approximates.",
        formatter_class=_DefaultsFormatter,
    )
    _shared(e, "study", "the study to export (under --runs-dir)", required=True)
    defaults = (f"{m.export_formats[0]} for a {m.name} study" for m in MODES.values())
    e.add_argument(
        "--format",
        choices=tuple(FORMATS),
        default=None,
        help="; ".join(f"{f.name}: {f.help}" for f in FORMATS.values())
        + f" (default: {', '.join(defaults)})",
    )
    e.add_argument("--out", default=None, help="folder (default: runs/<study>/export-<format>)")
    task = "the study's task (default: the one the search was given by name or file)"
    _shared(e, "task", task, default=None)
    e.add_argument(
        "--checkpoint",
        default=None,
        help="the trained fp32 weights, a state dict (default: the search's --checkpoint, "
        "else runs/<study>/fp32.pt, which only a serving search keeps: a training study's "
        "cann export needs it)",
    )
    devices: dict[str, list[str]] = {}
    for f in FORMATS.values():
        if f.device_help:
            default = "the study's" if f.converted else f.device
            devices.setdefault(f"{f.device_help} (default: {default})", []).append(f.name)
    said = (f"{', '.join(names)}: {what}" for what, names in devices.items())
    _shared(e, "device", "; ".join(said), default=None)
    _shared(e, "runs_dir", "where the search wrote its outputs")


def _add_search(commands: Any) -> None:
    s = commands.add_parser(
        "search",
        help="run a search (built-in task and local stores by default)",
        description="Train short real trials of candidate policies, record them in Optuna and "
        "MLflow, and write runs/<study>/best_policy.yaml and summary.json.",
        formatter_class=_DefaultsFormatter,
    )
    for section in SECTIONS:
        group = s.add_argument_group(section.title)
        for setting in options(section):
            _add_option(group, setting)
    files = s.add_argument_group("config file")
    files.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="read the settings from a YAML file in the sections --print-config writes; an "
        "option given on the command line overrides the file's",
    )
    files.add_argument(
        "--print-config",
        action="store_true",
        help="print the settings in effect as YAML (a --config file) and exit, searching nothing",
    )
    s.add_argument("--no-progress", action="store_true", help="no progress bar")


def _shared(parser: Any, name: str, help: str, **given: Any) -> None:
    """A search setting this command takes too (`_SHARED`) as declared, with this command's
    help and, in ``given``, its own ``default``, ``required`` or ``type``."""
    _add_option(parser, replace(declared(name), help=help, **given))


# The settings other commands share with the search (checked as declared, `_check_shared`).
_SHARED = ("study", "runs_dir", "tracking_uri", "task", "device", "mode", "seed", "emulate")


def _add_option(group: Any, setting: Option) -> None:
    """One declared setting as an option of the command."""
    if setting.switch:
        action = "store_false" if setting.default else "store_true"
        group.add_argument(setting.flag, dest=setting.name, action=action, help=setting.help)
        return
    group.add_argument(
        setting.flag,
        dest=setting.name,
        type=setting.scalar,
        action="append" if setting.repeated else "store",
        choices=setting.choices,
        default=list(default) if isinstance(default := setting.default, tuple) else default,
        metavar=setting.metavar,
        required=setting.required,
        help=setting.help,
    )


def _add_other_commands(commands: Any) -> None:
    """Every command but the search and the export, in the order --help lists them."""
    _add_profile(commands)
    _add_best(commands)
    _add_resolve(commands)
    _add_report(commands)
    _add_compare(commands)
    _add_ui(commands)


def _add_profile(commands: Any) -> None:
    """The `profile` command: every layer ranked by numerical risk."""
    pr = commands.add_parser(
        "profile",
        help="rank every layer by numerical risk in fp16/bf16, and fp8 with --emulate fp8 or "
        "on CUDA 8.9+ (one cheap pass, no search)",
        description="Train a few fp32 steps with every module watched (values past the "
        "low dtypes' range, values they would flush to zero), then run each module alone "
        "in fp16/bf16 and measure how far the loss and output move. Prints the ranking "
        "and writes runs/<study>/profile.json; also logged to MLflow.",
        formatter_class=_DefaultsFormatter,
    )
    _shared(pr, "task", "as for search")
    _shared(pr, "study", "study name (default: the task's name)")
    _shared(pr, "device", "as for search")
    pr.add_argument("--steps", type=int, default=3, help="fp32 training steps watched")
    _shared(pr, "seed", "seed of the weights and data order")
    pr.add_argument("--top", type=int, default=20, help="rows of the printed ranking")
    _shared(pr, "runs_dir", "where runs/<study>/profile.json goes")
    _shared(pr, "tracking_uri", "MLflow tracking URI")
    emulated = "as for search: with fp8 (run or emulated), each Linear's fp8 risk is ranked too"
    _shared(pr, "emulate", emulated)  # fp8 risk (issue 20)


def _add_best(commands: Any) -> None:
    """The `best` command: a study's best policy."""
    b = commands.add_parser(
        "best", help="print a study's best policy (from MLflow)", formatter_class=_DefaultsFormatter
    )
    _shared(b, "study", "the study whose best policy to print", required=True)
    _shared(b, "tracking_uri", "MLflow store the search used")
    b.add_argument("--json", action="store_true", help="print JSON instead of YAML")


def _add_resolve(commands: Any) -> None:
    """The `resolve` command: the dtype each layer runs in under a policy."""
    r = commands.add_parser(
        "resolve",
        help="show the dtype each layer of a task's model runs in under a policy, and how it lands",
        formatter_class=_DefaultsFormatter,
    )
    r.add_argument("--policy", required=True, help="policy YAML file")
    _shared(r, "task", "task whose model to resolve against")
    _shared(
        r,
        "mode",
        "training: the dtype each layer computes in under autocast; serving: the dtype "
        "its weights are served in (default: serving for a policy with int8 layers; "
        "inference: serving's earlier name)",
    )
    _shared(
        r,
        "device",
        "the device whose autocast decides what runs in which dtype: auto, cpu, cuda, "
        "npu (LayerNorm runs in fp32 on CUDA and Ascend, in its input's dtype on the CPU); "
        "a device that is not here is read from its table",
    )


def _add_report(commands: Any) -> None:
    """The `report` command: a study's HTML report."""
    rep = commands.add_parser(
        "report",
        help="write runs/<study>/report.html and PNG plots, and log them to the MLflow parent",
        formatter_class=_DefaultsFormatter,
    )
    _shared(rep, "study", "the study to report on (under --runs-dir)", required=True)
    _shared(rep, "runs_dir", "where the search wrote its outputs")
    _shared(
        rep,
        "tracking_uri",
        "MLflow store to log to (default: the one the search used)",
        default=None,
    )


def _add_compare(commands: Any) -> None:
    """The `compare` command: several studies on one page."""
    cmp_ = commands.add_parser(
        "compare",
        help="compare two or more studies on one page",
        formatter_class=_DefaultsFormatter,
    )
    _shared(
        cmp_,
        "study",
        "a study to compare (give two or more)",
        type=tuple[str, ...],
        required=True,
    )
    _shared(cmp_, "runs_dir", "where the searches wrote their outputs")
    cmp_.add_argument(
        "--out", default=None, help="HTML file (default: runs/compare-<studies>.html)"
    )


def _add_ui(commands: Any) -> None:
    """The `ui` command: the MLflow UI on a study's runs."""
    u = commands.add_parser(
        "ui",
        help="serve the MLflow UI and print the URL of a study's runs table",
        description="Start mlflow ui (one worker) on the tracking store and print a URL that "
        "opens the study's runs table: the trials flat, their metrics, dtypes and outcome as "
        "columns. Ctrl-C (or SIGTERM) stops the server and its workers.",
        formatter_class=_DefaultsFormatter,
    )
    _shared(u, "study", "the study to open (default: the one searched last)")
    _shared(u, "tracking_uri", "MLflow tracking URI")
    u.add_argument("--host", default="127.0.0.1", help="address the UI listens on")
    u.add_argument("--port", type=int, default=5000, help="port the UI listens on")


def _search(args: argparse.Namespace) -> int:
    from autoprec.progress import Progress
    from autoprec.report import front_table, gains_line
    from autoprec.report.headroom import forecast_lines, guard_line
    from autoprec.study import SearchConfig, search

    values = {declared.name: getattr(args, declared.name) for declared in options()}
    try:
        config = SearchConfig.from_options(values)
    except AutoprecError as error:
        raise AutoprecError(f"{error}{_in_config_file(str(error), args)}") from None
    if args.print_config:
        print(to_yaml({"task": args.task, "space": args.space, **config.option_values()}), end="")
        return 0
    progress = Progress(enabled=not args.no_progress, started_s=STARTED_S)
    result = search(args.task, args.space, config, progress)
    summary = result.typed or result.summary
    print(front_table(summary))
    print(gains_line(summary))
    if result.typed is not None and result.typed.confirmation is not None:
        print("\n".join(result.typed.confirmation.lines()))
    for line in [*forecast_lines(summary), guard_line(summary)]:
        if line is not None:
            print(line)
    print(f"best policy: {result.best_policy_path}")
    print(f"summary:     {result.summary_path}")
    print(f"compare:     autoprec ui --tracking-uri {redact(args.tracking_uri)}")
    print(progress.took(result.typed.phase_time_s if result.typed is not None else {}))
    return 0


def _profile(args: argparse.Namespace) -> int:
    from autoprec.devices import get_backend
    from autoprec.profile.sensitivity import profile_task
    from autoprec.tasks import load_task
    from autoprec.tracking import Tracker

    if args.steps < 1 or args.top < 1:
        raise AutoprecError("--steps and --top: expected positive integers")
    task = load_task(args.task)
    backend = get_backend(args.device, emulate=tuple(args.emulate))
    backend.check_training_emulation()
    study = check_study_name(args.study or task.name)
    profile = profile_task(task, backend, steps=args.steps, seed=args.seed)
    path = profile.save(Path(args.runs_dir) / study / "profile.json")
    tracker = Tracker(args.tracking_uri, study, Path(args.runs_dir))
    tracker.log_profile(profile, path, on_parent=False)
    tracker.close()
    print(profile.table(args.top))
    if profile.fp8_recipe:
        print(profile.fp8_table(args.top))
    print(f"profile: {path}")
    return 0


def _best(args: argparse.Namespace) -> int:
    from autoprec.errors import StoreError
    from autoprec.tracking import load_best_policy

    try:
        policy = load_best_policy(args.study, args.tracking_uri)
    except StoreError as error:
        names = _tracked_studies(args.tracking_uri)
        if args.study in names or not names:
            raise
        raise StoreError(f"{error}{_did_you_mean(args.study, names)}") from None
    print(
        json.dumps(policy.to_dict(), indent=2) if args.json else policy.to_yaml(),
        end="\n" if args.json else "",
    )
    return 0


def _resolve(args: argparse.Namespace) -> int:
    from autoprec.devices import device_kind, get_backend
    from autoprec.errors import PolicyError
    from autoprec.policy import load_policy
    from autoprec.report import text_table
    from autoprec.tasks import check_task, load_task

    policy = load_policy(args.policy)
    task = load_task(args.task)
    model = check_task(task)
    kind = get_backend(args.device).kind if args.device == "auto" else device_kind(args.device)
    mode = _mode_for(policy) if args.mode is None else mode_named(args.mode)
    # On this machine's own device kind, what runs is watched on one batch of the task.
    watched = mode.watches_batch and kind == get_backend("auto").kind
    example = task.first_val_batch() if watched else None
    try:
        table = policy.layer_table(model, kind, mode, example)
        share = policy.low_precision_share(model, kind, mode, example)
        where = mode.resolved_where(policy, model, kind, watched)
    except PolicyError as error:
        raise PolicyError(f"{args.policy}: {error}") from None
    columns = ["name", "type", "params", "dtype", *(["lands"] if mode.trains else [])]
    rows = [["module", *columns[1:]]]
    rows += [[str(r[column]) for column in columns] for r in table]
    print(text_table(rows))
    print(f"{where}; low-precision share of parameters: {share:.0%}")
    if mode.trains:  # trials that train nothing scale no loss
        print(f"loss scale: {policy.loss_scale.to_dict()}")
    return 0


def _mode_for(policy: Policy) -> Mode:
    """The mode ``autoprec resolve`` reads a policy in when --mode names none: the default,
    unless training cannot apply the policy (int8 layers, or fp8 ones by a serving
    method); then the first mode that trains nothing and takes every dtype it names."""
    default = mode_named(None)
    if not policy.serving_only:
        return default
    named = set(policy.named_dtypes)
    takes = (m for m in MODES.values() if not m.trains and named <= set(m.dtypes))
    return next(takes, default)


def without_password(uri: str | None) -> str | None:
    """A URI written with its password or token redacted, without the user part at all."""
    if uri is None or "***@" not in uri:
        return uri
    scheme, _, rest = uri.partition("://")
    return f"{scheme}://{rest.split('@', 1)[1]}"


def _did_you_mean(study: str, known: list[str]) -> str:
    """The end of a line refusing an unknown study: the closest name, else those there are."""
    from difflib import get_close_matches

    close = get_close_matches(study, known, n=1)
    if close:
        return f" (did you mean {close[0]!r}?)"
    if known:
        shown = ", ".join(repr(name) for name in sorted(known)[:5])
        return f" (its studies: {shown}{', ...' if len(known) > 5 else ''})"
    return " (run autoprec search first)"


def _check_study_exists(runs_dir: str, study: str) -> None:
    """A study with no summary under ``runs_dir`` is refused in one line naming the closest
    study that has one (a typo), before anything is read."""
    folder = Path(runs_dir)
    if (folder / study / "summary.json").is_file():
        return
    known = []
    if folder.is_dir():
        known = [entry.name for entry in folder.iterdir() if (entry / "summary.json").is_file()]
    raise AutoprecError(
        f"--study {study!r}: no study of that name in {folder}{_did_you_mean(study, known)}"
    )


def _tracked_studies(tracking_uri: str) -> list[str]:
    """The studies an MLflow store holds (its experiments' names, but MLflow's own
    "Default", id 0); none where it cannot be read."""
    from autoprec.tracking import mlflow_client

    try:
        experiments = mlflow_client(tracking_uri).search_experiments()
        return [e.name for e in experiments if e.experiment_id != "0"]
    except Exception:  # the store's own error was already said
        return []


def _read_summary(runs_dir: str, study: str) -> Summary:
    from autoprec.study._summary_file import read_summary

    _check_study_exists(runs_dir, study)
    return read_summary(Path(runs_dir) / study / "summary.json", study)


def _report(args: argparse.Namespace) -> int:
    from autoprec.report import render_report
    from autoprec.report.text import retry_lines
    from autoprec.tracking import Tracker

    summary = _read_summary(args.runs_dir, args.study)
    files = render_report(summary, Path(args.runs_dir) / args.study, Path(args.runs_dir))
    for line in retry_lines(summary):  # the report's table says so too
        print(line)
    # The summary holds the URI with its password redacted: without one, MLflow takes
    # MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD from the environment.
    uri = args.tracking_uri or without_password(summary.settings.tracking_uri)
    parent = summary.mlflow_parent_run_id
    if uri and parent:
        Tracker(uri, args.study, Path(args.runs_dir)).log_files(parent, files, "report")
    for path in files:
        print(path)
    return 0


def _export(args: argparse.Namespace) -> int:
    import warnings

    from autoprec._util.files import refuse_links
    from autoprec.exports import ExportWarning, export_policy
    from autoprec.policy import load_policy
    from autoprec.study._summary_file import read_header
    from autoprec.tasks import check_task, load_task
    from autoprec.trials.serving import FP32_CHECKPOINT, load_checkpoint

    _check_study_exists(args.runs_dir, args.study)
    header = read_header(Path(args.runs_dir) / args.study / "summary.json", args.study)
    settings, mode = header.settings, mode_named(header.mode)
    fmt = FORMATS[args.format or mode.export_formats[0]]
    if fmt.name not in mode.export_formats:
        raise AutoprecError(
            f"--format {fmt.name}: {_format_modes(fmt.name)}; {args.study!r} is a "
            f"{mode.name} study, {mode.policy_use}"
        )
    folder = Path(args.runs_dir) / args.study
    policy = load_policy(folder / "best_policy.yaml")
    spec = args.task or settings.task_spec
    model = example = None
    if fmt.loads_model(task_known=spec is not None):
        if spec is None:
            raise AutoprecError(
                f"study {args.study!r} was given its task as an object: name it with --task"
            )
        task = load_task(spec)
        model = check_task(task)
        weights = args.checkpoint or settings.checkpoint or folder / FP32_CHECKPOINT
        if fmt.trained and not Path(weights).is_file():
            missing = "{weights} does not exist" if args.checkpoint else mode.missing_weights
            why = missing.format(weights=weights)
            raise AutoprecError(
                f"--format {fmt.name}: no trained fp32 weights ({why}); pass --checkpoint PATH, "
                "your trained model's state dict (torch.save(model.state_dict(), PATH))"
            )
        if Path(weights).is_file():
            model = load_checkpoint(model, Path(weights), task)
        example = task.first_val_batch()
    device = args.device or (settings.device if fmt.converted else None)
    out = Path(args.out or folder / f"export-{fmt.name}")
    if args.out is None:  # no link below the runs folder is followed (a folder named is)
        refuse_links(out, args.runs_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportWarning)
        paths = export_policy(policy, fmt.name, out, model, example, device, settings.int8, spec)
    for warning in caught:
        if issubclass(warning.category, ExportWarning):
            print(f"autoprec export: note: {warning.message}", file=sys.stderr)
    for path in paths:
        print(path)
    return 0


def _format_modes(fmt: str) -> str:
    """Which modes' studies export ``fmt``: ``for serving studies (--mode serving)``."""
    allowing = [m.name for m in MODES.values() if fmt in m.export_formats]
    if not allowing:
        return "no study exports it"
    return f"for {' or '.join(allowing)} studies (--mode {allowing[0]})"


def _compare(args: argparse.Namespace) -> int:
    from autoprec.report import render_comparison

    if len(args.study) < 2:
        raise AutoprecError("--study: give two or more studies to compare")
    summaries = [_read_summary(args.runs_dir, study) for study in args.study]
    out = Path(args.out or Path(args.runs_dir) / f"compare-{'-'.join(args.study)}.html")
    # Below the runs folder no link is followed; a page the user names is written there.
    print(render_comparison(summaries, out, None if args.out else Path(args.runs_dir)))
    return 0


def _ui(args: argparse.Namespace) -> int:
    from autoprec._util.server_process import check_port_free, serve
    from autoprec.ui import check_store_exists, find_runs_view, write_runs_view

    if not 0 < args.port < 65536:
        raise AutoprecError(f"--port {args.port}: expected a port from 1 to 65535")
    check_store_exists(args.tracking_uri)
    mlflow = shutil.which("mlflow")
    if mlflow is None:
        raise AutoprecError("the 'mlflow' command is not on PATH; install mlflow")
    check_port_free(args.host, args.port)
    command = [mlflow, "ui", "--backend-store-uri", args.tracking_uri]
    command += ["--host", args.host, "--port", str(args.port), "--workers", "1"]
    shown = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    shown = f"[{shown}]" if ":" in shown else shown
    base = f"http://{shown}:{args.port}"
    views: list[Any] = []

    def prepare() -> None:
        """While the server starts (tens of seconds): the URI checked, the study's view
        found and written. An error here stops the server before it answers."""
        views.append(find_runs_view(args.tracking_uri, args.study))
        if views[0] is not None:
            write_runs_view(args.tracking_uri, views[0])
        print(f"starting the MLflow UI on {base} ...", file=sys.stderr, flush=True)

    def ready() -> None:
        view = views[0]
        where = f"study {view.study}: {base}{view.path}" if view else f"no study yet: {base}"
        print(f"MLflow UI: {where} (Ctrl-C to stop)", file=sys.stderr, flush=True)

    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    return serve(command, env, f"{base}/health", ready, prepare)


def _check_shared(args: argparse.Namespace) -> None:
    """The settings a command shares with the search, checked as declared before anything
    is read or written (a ``--study`` cannot lead outside the runs folder)."""
    for name in _SHARED if args.command != "search" else ():
        setting, values = declared(name), getattr(args, name, None)
        several = isinstance(values, list) and not setting.repeated  # compare's --study
        for value in values if several and values is not None else [values]:
            if value is not None:  # the command's own default: none given
                setting.checked(value)


def _with_config_file(
    parser: argparse.ArgumentParser, argv: list[str] | None, args: argparse.Namespace
) -> argparse.Namespace:
    """``autoprec search --config FILE``: the command line parsed again over the file's
    settings as its defaults, so that an option given there overrides the file."""
    if args.command != "search" or args.config is None:
        return args
    values = read_file(args.config)
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands.choices["search"].set_defaults(**values)
    args = parser.parse_args(argv)
    args.config_values = values
    return args


def _in_config_file(message: str, args: argparse.Namespace) -> str:
    """Where a refused setting came from, when the config file gave it: `` (what.trials in
    search.yaml)`` for a message that starts with its option (``--trials: ...``)."""
    given = getattr(args, "config_values", {})
    named = message.split(":")[0].split(" ")[0]
    for setting in options():
        from_file = setting.name in given and getattr(args, setting.name) == given[setting.name]
        if named in (setting.flag, setting.name) and from_file:  # and not overridden
            return f" ({setting.section}.{setting.name} in {args.config})"
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    handler = {
        "search": _search,
        "profile": _profile,
        "best": _best,
        "resolve": _resolve,
        "report": _report,
        "compare": _compare,
        "export": _export,
        "ui": _ui,
    }[args.command]
    try:
        args = _with_config_file(parser, argv, args)
        _check_shared(args)
        return handler(args)
    except AutoprecError as error:
        print(f"autoprec {args.command}: error: {redact(str(error))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as interrupt:
        result = getattr(interrupt, "result", None)
        where = f"; results so far in {result.summary_path}" if result else ""
        print(f"\nautoprec {args.command}: interrupted{where}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
