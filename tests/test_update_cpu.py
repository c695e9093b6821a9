"""Sender CPU time per update: UpdateReport.cpu_seconds (the sender's process, all threads) and
caller_cpu_seconds (the thread that ran update()), printed and in JSON by `p2pweights demo`."""
from __future__ import annotations

import json
import threading
import time

from p2pweights.sender.report import UpdateTimes
from replica_configs import write_config


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_cpu_is_counted_from_the_update_start_and_splits_the_callers_thread_from_the_others():
    # CPU seconds, not wall time, so a loaded machine does not move them; the bounds sit halfway
    # between "counted" and "not counted" to leave room for the process's other threads
    _burn(0.6)  # before the update: not its CPU
    times = UpdateTimes()
    _burn(0.1)  # the update's own thread
    other = threading.Thread(target=_burn, args=(0.3,))  # a writer/transport thread of the process
    other.start()
    other.join()
    process, caller = times.cpu_used()
    assert 0.1 <= caller < 0.1 + 0.3  # its own burn; with the 0.6 s before it would be >= 0.7
    assert process >= caller + 0.3 - 0.02  # the other thread's burn is the process's (thread_time granularity)
    assert process < 0.4 + 0.3  # the 0.6 s burnt before UpdateTimes() is not counted (it would be >= 1.0)


def test_cpu_of_the_caller_is_none_when_asked_from_another_thread():
    times = UpdateTimes()
    got = []
    t = threading.Thread(target=lambda: got.append(times.cpu_used()))
    t.start()
    t.join()
    process, caller = got[0]
    assert process >= 0 and caller is None


def test_demo_reports_each_senders_cpu_per_step_in_text_and_json(tmp_path):
    """A real demo step (engine processes, forked senders, Mooncake over loopback)."""
    from p2pweights.commands.demo_run import results_json, run_demo

    cfg = write_config("qwen3", str(tmp_path))
    lines = []
    results = run_demo(cfg, engines=1, engine="tp=2", senders=2, steps=1, transport="mooncake", modes=("p2p",),
                       progress=lines.append)
    steps = json.loads(json.dumps(results_json(results)))["steps"]
    assert len(steps) == 1 and steps[0]["equal"] is True
    cpu, caller = steps[0]["sender_cpu_seconds"], steps[0]["sender_caller_cpu_seconds"]
    assert len(cpu) == 2 and all(c > 0 for c in cpu)
    # the update ran on the sender's main thread: its share is known, positive and within the process's
    assert all(c is not None and 0 < c <= p + 1e-3 for c, p in zip(caller, cpu))
    row = next(line for line in lines if "step 1" in line and "p2p" in line)
    assert "sender CPU " + "/".join(f"{c:.2f}" for c in cpu) in row
