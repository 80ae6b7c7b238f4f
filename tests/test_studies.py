"""The study storage that workers share: a queued trial is handed to one process only."""

import json
import subprocess
import sys
import time

import optuna

from autoprec.studies import open_storage

# Each process waits for the same moment, then takes queued trials until none is left,
# and prints the numbers it was handed.
_TAKE = """
import json, sys, time
import optuna
from autoprec.studies import open_storage
url, start = sys.argv[1], float(sys.argv[2])
study = optuna.load_study(study_name="queue", storage=open_storage(url))
time.sleep(max(0.0, start - time.time()))
taken = []
while True:
    trial = study.ask()
    if "slot" not in trial.user_attrs:  # the queue is empty: a fresh trial
        break
    taken.append(trial.number)
print(json.dumps(taken))
"""


def test_four_processes_taking_from_one_sqlite_queue_never_take_the_same_trial(tmp_path):
    # Optuna alone hands some of these 40 trials to two processes at once on sqlite
    # (5 to 10 a run here).
    url = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(study_name="queue", storage=open_storage(url))
    for slot in range(40):
        study.enqueue_trial({}, user_attrs={"slot": slot})
    start = time.time() + 5.0  # after every process has imported optuna
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _TAKE, url, str(start)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    taken = []
    for p in processes:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0
        taken.extend(json.loads(out))
    assert sorted(taken) == list(range(40))
