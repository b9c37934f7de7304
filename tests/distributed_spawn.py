"""Running a test's ranks: gloo process groups on this machine (127.0.0.1 only), processes
started with torch.multiprocessing (spawn), killed past a deadline so that CI never hangs.
Each rank writes what it saw to a file the test reads back and compares."""

from __future__ import annotations

import faulthandler
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_entry(
    rank: int, world_size: int, port: int, out_dir: str, main: Callable[[int, int], object]
) -> None:
    """One rank: joins the group over loopback, runs main(rank, world_size), saves its
    result as rank<N>.pt."""
    # A rank killed by a signal (SIGABRT from glibc's heap checks, SIGSEGV) reaches the
    # test as a bare exit signal; this prints its Python stack to the captured stderr.
    faulthandler.enable()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)  # the ranks share this machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.save(main(rank, world_size), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(
    main: Callable[[int, int], object], world_size: int, out_dir: Path, timeout_s: float
) -> list:
    """Spawns `world_size` ranks running `main` (a module-level function) and returns what
    each returned, in rank order; fails the test past timeout_s."""
    context = mp.start_processes(
        rank_entry,
        args=(world_size, free_port(), str(out_dir), main),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"{world_size} ranks did not finish within {timeout_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(world_size)]
