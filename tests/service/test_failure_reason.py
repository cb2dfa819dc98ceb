"""A failed run's reason is one readable sentence (the innermost error); the full text is kept as an event."""

from __future__ import annotations

from service.runs.lifecycle import MAX_SENTENCE_CHARS, one_sentence

RAY_TRACE = """Training worker 1 failed:
Traceback (most recent call last):
  File "/w/loop.py", line 428, in _save
    save_checkpoint(path, ...)
  File "/w/checkpoint.py", line 330, in save_checkpoint
    dcp.save(state, storage_writer=writer)
ray.exceptions.RayTaskError(OSError): ray::RayTrainWorker.run() (pid=1, ip=127.0.0.1)
OSError: [Errno 30] Read-only file system: '/ck/step_00000002.partial/__1_0.distcp'
""" + "x" * 1950


def test_a_traceback_becomes_its_innermost_error_line():
    assert one_sentence(RAY_TRACE) == "OSError: [Errno 30] Read-only file system: '/ck/step_00000002.partial/__1_0.distcp'"
    assert one_sentence("workers.user_code.UserCodeError: model.tp_plan pattern 'x' matches no module") == (
        "UserCodeError: model.tp_plan pattern 'x' matches no module")
    assert one_sentence("the Ray head died") == "the Ray head died"
    assert one_sentence("") == "unknown error"
    long = one_sentence("ValueError: " + "y" * 1000)
    assert len(long) == MAX_SENTENCE_CHARS and "\n" not in long
