"""What README.md and the docs pages tell a user to type is what is tested: every
``autoprec ...`` line of their ```bash blocks runs as typed, with the progress bar on, in a
pseudo-terminal (where tqdm draws; searches of both modes, and every other line, also
piped), and must exit 0; their ```python blocks marked ``<!-- runnable ... -->`` run as
written, and one whose first line is ``# name.py`` is written to that file. The pages are
README.md, then every page of mkdocs.yml's ``nav`` in its order, read by the same rules; a
line of any of them this file does not handle fails `test_every_readme_command_is_handled`.

Only what a line leaves open or what this machine lacks is changed, each in `HANDLED`:
- budgets: ``--trials`` and ``--steps`` of a search are made small (set, or added where the
  line leaves them at their defaults);
- hosts: ``db.example`` and ``10.0.0.5:5000`` become a local PostgreSQL server and
  ``mlflow server`` (tests/servers.py);
- NPUs: ``npu:0-7`` runs on the torch_npu stand-in with 8 devices (tests/npu_standin);
- ``autoprec ui`` gets a free ``--port``, is asked for its page, then stopped with Ctrl-C.
Files a line names (``my_task.py``, ``my_weights.pt``) are made by the pages' own snippets,
run before it in the pages' order.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import pty
import re
import select
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from autoprec.devices import cpu_scaled_mm_error
from tests import npu_standin
from tests.servers import free_port, mlflow_server, postgres, postgres_bin

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MKDOCS = REPO / "mkdocs.yml"
README_MAX_LINES = 250
RUNNABLE = "<!-- runnable"  # the marker line before a ```python block that runs as written
SMALL = {"--trials": "2", "--steps": "12"}
GUARD_S = 900  # a hung command fails the test rather than hold CI; never a measured time


@dataclass(frozen=True)
class Handling:
    """How one README line runs here: the budget made small (``budget`` flags set to
    ``SMALL``), the hosts swapped, the NPU stand-in, or as a server stopped by Ctrl-C."""

    budget: tuple[str, ...] = ()
    servers: bool = False  # --storage / --tracking-uri on local PostgreSQL and MLflow
    npus: int = 0  # devices of the torch_npu stand-in
    serves: bool = False  # runs until Ctrl-C; it must answer HTTP first
    draws: bool = False  # a search: its progress bar must show the best so far
    writes: bool = False  # ends in ``> FILE``: its standard output goes to that file
    # trains in emulated fp8: on a CPU whose torch._scaled_mm has no kernel, it must be
    # refused in one line (exit 2), as docs/fp8.md says
    trains_fp8: bool = False


SEARCH = Handling(budget=("--trials", "--steps"), draws=True)
HANDLED: dict[str, Handling] = {
    "autoprec search": SEARCH,
    "autoprec search --trials 3 --steps 50": SEARCH,
    "autoprec search --task digits-cnn --prefer memory --trials 6 --steps 60": SEARCH,
    "autoprec search --task my_task.py:make_task --trials 30 --steps 100 --device auto": SEARCH,
    "autoprec report --study digits-mlp": Handling(),
    "autoprec compare --study digits-mlp --study digits-cnn": Handling(),
    "autoprec ui": Handling(serves=True),
    "autoprec search --task digits-overflow --trials 20 --steps 60 --prefer memory": SEARCH,
    "autoprec search --task tiny-gpt2 --prefer memory --trials 10 --steps 60": SEARCH,
    "autoprec search --task my_task.py:make_task --study my-task-long --trials 30 --steps 100 "
    "--confirm-steps 500 --trial-schedule compressed": SEARCH,
    "autoprec profile --task digits-overflow": Handling(),
    "autoprec profile --task fp8-outliers --emulate fp8": Handling(trains_fp8=True),
    "autoprec search --task late-overflow --train-steps 2000": SEARCH,
    "autoprec search --mode serving --scenario edge": SEARCH,
    "autoprec search --mode serving --scenario server --batch-sizes 1,64": SEARCH,
    "autoprec search --mode serving --scenario critical --checkpoint my_weights.pt": SEARCH,
    "autoprec export --study digits-mlp-edge": Handling(),
    "autoprec search --mode serving --emulate fp8 --int8 off --study digits-mlp-fp8": SEARCH,
    "autoprec search --task my_task.py:make_task --study my-task-npu --trials 200 --steps 300 "
    "--workers 8 --devices npu:0-7": Handling(budget=("--trials", "--steps"), npus=8, draws=True),
    "autoprec search --task my_task.py:make_task --study resnet-npu --trials 400 --steps 300 "
    "--storage postgresql://autoprec@db.example/optuna --tracking-uri http://10.0.0.5:5000 "
    "--workers 8 --devices npu:0-7": Handling(
        budget=("--trials", "--steps"), servers=True, npus=8, draws=True
    ),
    "autoprec search --task digits-mlp --study digits-mlp-2ranks --trials 6 --nproc-per-trial 2 "
    "--device cpu": SEARCH,
    "autoprec search --print-config > search.yaml": Handling(writes=True),
    "autoprec search --config search.yaml --trials 4 --steps 50": SEARCH,
    "autoprec --version": Handling(),
    "autoprec search --trials 4 --steps 50 --workers 2 --study digits-mlp-2workers": SEARCH,
}
FAST = ("autoprec search", "autoprec search --mode serving --scenario edge")


# -- what the README says -------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One thing the README has a user do, in its order: a command, a Python snippet to
    run, or a file to write (a ```python block whose first line is ``# name.py``)."""

    kind: str  # "command", "python" or "file"
    text: str
    name: str = ""


def repeated_blocks(text: str) -> list[tuple[str, str, str]]:
    """(language, body, the line before the block) of every fenced code block."""
    found = re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)
    return [(m[1], m[2], text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()) for m in found]


def _commands(body: str) -> list[str]:
    """The ``autoprec ...`` commands of a bash block: continuation lines joined, comments
    dropped, each command of a ``&&`` chain on its own."""
    commands = []
    for line in body.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        command: list[str] = []
        for word in [*words, "&&"]:
            if word != "&&":
                command.append(word)
                continue
            if command[:1] == ["autoprec"]:
                commands.append(" ".join(command))
            command = []
    return commands


def _nav_pages(nav: list) -> list[str]:
    """The Markdown files of an mkdocs ``nav``, in its order (sections walked in place)."""
    found = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            found += _nav_pages(value) if isinstance(value, list) else [value]
    return found


def docs_pages() -> list[Path]:
    """The docs site's pages, as mkdocs.yml's ``nav`` lists them."""
    config = yaml.safe_load(MKDOCS.read_text())
    return [REPO / config["docs_dir"] / page for page in _nav_pages(config["nav"])]


def readme_steps() -> list[Step]:
    """The steps of README.md, then of every docs page, in that order."""
    return [step for steps in pages_steps().values() for step in steps]


def pages_steps() -> dict[str, list[Step]]:
    """Each page's steps, README.md's first, then the docs pages in mkdocs.yml's order."""
    return {page.name: _page_steps(page.read_text()) for page in [README, *docs_pages()]}


# Pages whose commands use what another page's steps made, walked as one unit after it:
# Serving search's ``--checkpoint my_weights.pt`` is the file the README's loop saves.
WALKED_AFTER = {"serving-search.md": "README.md"}


def walks() -> dict[str, list[Step]]:
    """The pages' steps as independent walks, each in a folder of its own: a page's own
    steps, after those of the page it needs (`WALKED_AFTER`); pages without commands or
    snippets are left out. Every file step (``my_task.py``) is in every walk, first."""
    pages = pages_steps()
    files = [step for steps in pages.values() for step in steps if step.kind == "file"]
    found: dict[str, list[Step]] = {}
    for name, steps in pages.items():
        if name in WALKED_AFTER.values():
            continue
        after = WALKED_AFTER.get(name)
        walked = [*pages.get(after or "", []), *steps]
        if any(step.kind != "file" for step in walked):
            label = f"{after}+{name}" if after else name
            found[label] = [*files, *(step for step in walked if step.kind != "file")]
    return found


def _page_steps(text: str) -> list[Step]:
    steps = []
    for language, body, before in repeated_blocks(text):
        if language == "bash":
            steps += [Step("command", c) for c in _commands(body)]
        elif language == "python" and (name := re.match(r"# (\w+\.py)\n", body)):
            steps.append(Step("file", body, name[1]))
        elif language == "python" and before.startswith(RUNNABLE):
            steps.append(Step("python", body))
    return steps


def readme_commands() -> list[str]:
    return list(dict.fromkeys(s.text for s in readme_steps() if s.kind == "command"))


# -- how a line runs here ---------------------------------------------------------------


@dataclass
class Machine:
    """What this machine puts in place of what it lacks."""

    hosts: dict[str, str] = field(default_factory=dict)  # README's host -> local server

    def argv(self, command: str, handling: Handling) -> list[str]:
        for theirs, ours in self.hosts.items():
            command = command.replace(theirs, ours)
        words = shlex.split(command)[1:]
        for flag in handling.budget:
            if flag in words:
                words[words.index(flag) + 1] = SMALL[flag]
            else:
                words += [flag, SMALL[flag]]
        if handling.serves:
            words += ["--port", str(free_port())]
        return [*_autoprec(), *words]

    def env(self, handling: Handling) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(_python_path()), "COLUMNS": "100"}
        if handling.npus:
            env = npu_standin.subprocess_env(NPU_STANDIN_DEVICES=str(handling.npus))
        return env


def _python_path() -> list[str]:
    return [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]


def _autoprec() -> list[str]:
    """The ``autoprec`` command as installed beside this Python (as a user runs it)."""
    script = Path(sys.executable).with_name("autoprec")
    if script.is_file():
        return [str(script)]
    found = shutil.which("autoprec")
    return [found] if found else [sys.executable, "-m", "autoprec.cli"]


def run_piped(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=GUARD_S)
    return done.returncode, done.stdout + done.stderr


def _start_in_pty(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    """The command on a new pseudo-terminal of 100 columns (stdin, stdout and stderr), as in
    a terminal window; its terminal's master end."""
    master, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    process = subprocess.Popen(
        argv, cwd=cwd, env=env, stdin=child, stdout=child, stderr=child, start_new_session=True
    )
    os.close(child)
    return process, master


def _read_all(process: subprocess.Popen, master: int) -> str:
    """What the terminal shows until the command closes it (read as it comes: a full
    terminal would block the command)."""
    chunks = []
    deadline = time.monotonic() + GUARD_S
    while time.monotonic() < deadline:
        if select.select([master], [], [], 1.0)[0]:
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: every end of the terminal on the command's side closed
                break
            if not data:
                break
            chunks.append(data)
    os.close(master)
    process.wait(timeout=60)
    return b"".join(chunks).decode(errors="replace")


def run_in_pty(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    process, master = _start_in_pty(argv, cwd, env)
    try:
        output = _read_all(process, master)
    finally:
        _stop(process)
    return process.returncode, output


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)


def serve_then_ctrl_c(argv: list[str], cwd: Path, env: dict[str, str], pty_: bool) -> str:
    """A server line (``autoprec ui``): it must answer HTTP on its port, and a Ctrl-C (SIGINT
    to its process group, as a terminal sends it) must end it."""
    port = argv[argv.index("--port") + 1]
    if pty_:
        process, master = _start_in_pty(argv, cwd, env)
    else:
        process = subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + GUARD_S
        while not _answers(f"http://127.0.0.1:{port}/"):
            assert process.poll() is None, f"{argv} exited with {process.returncode}"
            assert time.monotonic() < deadline, f"{argv}: no page in {GUARD_S} s"
            time.sleep(1)
        os.killpg(process.pid, signal.SIGINT)
        if pty_:
            output = _read_all(process, master)
        else:
            output = process.communicate(timeout=120)[0].decode(errors="replace")
    finally:
        _stop(process)
    # Ctrl-C is how a server is meant to end: 130 (interrupted), or 0 if it exits cleanly;
    # a traceback of autoprec's own would be status 1. (MLflow's workers, stopped by the
    # same Ctrl-C, may print what they like.)
    assert process.returncode in (0, 130), output[-3000:]
    return output


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status == 200
    except OSError:
        return False


def run_step(step: Step, folder: Path, machine: Machine, pty_: bool) -> None:
    """One README step in ``folder``, as a user takes it."""
    if step.kind == "file":
        (folder / step.name).write_text(step.text)
        return
    env = machine.env(Handling())
    if step.kind == "python":
        code, output = (run_in_pty if pty_ else run_piped)(
            [sys.executable, "-c", step.text], folder, env
        )
        assert code == 0, f"README snippet failed:\n{step.text}\n{output[-3000:]}"
        return
    handling = HANDLED[step.text]
    if handling.writes:
        write_stdout(step.text, folder, machine, handling)
        return
    argv, env = machine.argv(step.text, handling), machine.env(handling)
    if handling.serves:
        serve_then_ctrl_c(argv, folder, env, pty_)
        return
    code, output = (run_in_pty if pty_ else run_piped)(argv, folder, env)
    where = "in a terminal" if pty_ else "piped"
    if handling.trains_fp8 and cpu_scaled_mm_error() is not None:
        refused = [line for line in output.splitlines() if "--emulate fp8:" in line]
        assert code == 2 and len(refused) == 1, f"`{step.text}` ({where}):\n{output[-4000:]}"
        return
    assert code == 0, f"`{step.text}` ({where}) exited {code}:\n{output[-4000:]}"
    assert "Traceback" not in output, output[-4000:]
    if handling.draws:  # the bar, with the best so far by the mode's own time
        label = "latency" if "--mode serving" in step.text else "step"
        assert f": {label} " in output and " ms, " in output, f"no bar:\n{output[-2000:]}"


def write_stdout(command: str, folder: Path, machine: Machine, handling: Handling) -> None:
    """A line ending in ``> FILE``, as a shell runs it: the standard output into the file
    (in the folder), errors on the terminal."""
    command, _, target = command.rpartition(" > ")
    with open(folder / target.strip(), "w") as out:
        done = subprocess.run(
            machine.argv(command, handling), cwd=folder, env=machine.env(handling),
            stdout=out, stderr=subprocess.PIPE, text=True, timeout=GUARD_S,
        )  # fmt: skip
    assert done.returncode == 0, f"`{command}` exited {done.returncode}:\n{done.stderr[-4000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-4000:]


# -- the tests --------------------------------------------------------------------------


def test_every_readme_command_is_handled():
    commands = readme_commands()
    assert len(commands) >= 10, commands  # the parser still finds the README's commands
    unhandled = [c for c in commands if c not in HANDLED]
    assert unhandled == [], f"README or docs commands this test does not run: {unhandled}"
    stale = [c for c in HANDLED if c not in commands]
    assert stale == [], f"handled but no longer in the README or the docs: {stale}"
    assert set(FAST) <= set(commands)


def test_the_parser_joins_continuations_and_chains():
    body = "pip install x && autoprec search   # note\nautoprec search --a 1 \\\n    --b 2\n"
    assert _commands(body) == ["autoprec search", "autoprec search --a 1 --b 2"]


def test_the_readme_is_short_and_every_docs_page_exists():
    assert len(README.read_text().splitlines()) <= README_MAX_LINES
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README.read_text())
    assert [link for link in links if not (REPO / link).is_file()] == [], links
    pages = docs_pages()
    assert len(pages) >= 12, pages  # the nav is still read
    missing = [str(p.relative_to(REPO)) for p in pages if not p.is_file()]
    assert missing == [], f"pages mkdocs.yml lists that do not exist: {missing}"
    docs = REPO / "docs"
    unlisted = {p for p in docs.rglob("*.md") if "hooks" not in p.parts} - set(pages)
    assert unlisted == set(), (
        f"pages mkdocs.yml does not list (their commands go untested): {unlisted}"
    )


def test_the_option_reference_lists_every_option_of_every_command():
    """docs/reference/options.md is filled from the parser when the site is built: every
    subcommand gets a section and every option a row, with its default as --help says."""
    import argparse

    from autoprec.cli import _build_parser

    spec = importlib.util.spec_from_file_location("options_hook", REPO / "docs/hooks/options.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = (REPO / "docs/reference/options.md").read_text()
    assert hook.MARKER in page
    reference = hook.on_page_markdown(page, page=None)
    parser = _build_parser()
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        assert f"## autoprec {name}\n" in reference
        for action in sub._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}" in reference, f"autoprec {name} {option}"
    assert "`--trials TRIALS` | total trials" in reference and "(default: 12)" in reference


def test_the_readme_snippets_that_run_are_found():
    steps = readme_steps()
    assert [s.name for s in steps if s.kind == "file"] == ["my_task.py"]
    snippets = [s.text for s in steps if s.kind == "python"]
    assert any("load_best_policy" in s and "prec.step(optimizer)" in s for s in snippets)


@pytest.mark.parametrize(
    ("command", "pty_"),
    [
        pytest.param(FAST[0], False, id="search-piped"),
        pytest.param(FAST[1], True, id="serving-terminal"),
        pytest.param(FAST[0], True, id="search-terminal", marks=pytest.mark.slow),
        pytest.param(FAST[1], False, id="serving-piped", marks=pytest.mark.slow),
    ],
)
def test_the_first_commands_run_as_typed(command, pty_, tmp_path):
    """The default search and the serving search, each in a fresh folder, one piped and one
    in a terminal in the quick subset, the other two ways in the slow one; after the default
    search, the Quick start's own loop (move 2) runs as written on the policy it found."""
    machine = Machine()
    run_step(Step("command", command), tmp_path, machine, pty_)
    if command == "autoprec search":
        loop = next(s for s in readme_steps() if s.kind == "python")
        run_step(loop, tmp_path, machine, pty_)
        assert (tmp_path / "my_weights.pt").is_file()


def test_the_config_file_commands_run_as_typed(tmp_path):
    """Training search's ``--print-config > search.yaml``, then the search that reads it
    (in a terminal), in one folder: without the PostgreSQL the whole walk needs."""
    commands = [c for c in readme_commands() if "config" in c]
    assert commands == [
        "autoprec search --print-config > search.yaml",
        "autoprec search --config search.yaml --trials 4 --steps 50",
    ]
    for command in commands:
        run_step(Step("command", command), tmp_path, Machine(), pty_=True)
    assert (tmp_path / "search.yaml").read_text().startswith("# what is searched\nwhat:\n")
    assert (tmp_path / "runs/digits-mlp/summary.json").is_file()


def _walk_param(name: str, steps: list[Step]):
    """A walk as a test case: slow, and skipped where its hosts need what is missing."""
    marks = [pytest.mark.slow]
    if any(step.kind == "command" and HANDLED[step.text].servers for step in steps):
        missing = postgres_bin() is None or importlib.util.find_spec("psycopg") is None
        marks.append(pytest.mark.skipif(missing, reason="PostgreSQL or psycopg is missing"))
    return pytest.param(steps, id=name.replace(".md", ""), marks=marks)


# The walks with most steps first: xdist hands out the longest while the rest is shared.
@pytest.mark.parametrize(
    "steps",
    [_walk_param(name, s) for name, s in sorted(walks().items(), key=lambda w: -len(w[1]))],
)
def test_every_readme_command_runs_as_typed(steps, tmp_path):
    """Every step of a page (`walks`) in its order, in one folder (later lines use what
    earlier ones made), each command in a terminal, where the bar draws. A command that is
    not a search also runs piped; searches run piped in `test_the_first_commands_run_as_typed`
    (training and serving: the bar's code does not ask which device or store it is on),
    so the suite does not pay for every search twice. A page is a test of its own, so that
    the workers share the pages."""
    with contextlib.ExitStack() as hosts:
        machine = Machine()
        if any(step.kind == "command" and HANDLED[step.text].servers for step in steps):
            pg = hosts.enter_context(postgres(("optuna", "mlflow")))
            tracking = hosts.enter_context(mlflow_server(f"{pg}/mlflow", tmp_path / "artifacts"))
            host = pg.removeprefix("postgresql://")
            machine = Machine({"autoprec@db.example": host, "http://10.0.0.5:5000": tracking})
        folder = tmp_path / "user"
        folder.mkdir()
        for step in steps:
            if step.kind != "command" or not HANDLED[step.text].draws:
                run_step(step, folder, machine, pty_=False)
            if step.kind == "command":
                run_step(step, folder, machine, pty_=True)


def test_the_walks_take_every_step_once():
    """The walks together take every step of every page once, and the files first in each."""
    walked = [step for steps in walks().values() for step in steps if step.kind != "file"]
    assert Counter(walked) == Counter(step for step in readme_steps() if step.kind != "file")
    assert len(walks()) >= 10, list(walks())  # the pages are still walked one by one
    for steps in walks().values():
        kinds = [step.kind for step in steps]
        assert kinds == sorted(kinds, key=lambda kind: kind != "file")
