"""Keeps torch.profiler's kineto library from printing its trace-point and device-probe lines
into the bench's and the study's output: "USDT: ... profiler_start" / "profiler_stop" around
every profiled call and, on a CUDA build of torch without a GPU, "ERROR: ...
gpuGetDeviceCount failed with code 35". Neither says anything about the results."""

from __future__ import annotations

import os

# kineto prints what is at or above KINETO_LOG_LEVEL, on its scale VERBOSE 0, INFO 1,
# WARNING 2, STAGE 3, ERROR 4, USDT 5: the trace points rank above errors, so only a level
# above them all silences them. kineto reads the variable when the first profiler starts.
ABOVE_EVERY_LEVEL = "6"


def quiet_kineto() -> None:
    """Call before the process's first profiler; a KINETO_LOG_LEVEL set by the user wins."""
    os.environ.setdefault("KINETO_LOG_LEVEL", ABOVE_EVERY_LEVEL)
