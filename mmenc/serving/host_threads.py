"""Torch's intra-op threads in the service's processes.

The service runs torch's CPU ops in many threads at once: pool threads preprocess images (mmenc.serving.
preprocess: a processor without the per-image API, SigLIP's, runs whole in float32 torch ops) and render
answers. torch's OpenMP build gives each calling thread a team of one thread per core for its parallel
ops, so on a 16-core H200 host 16 pool threads made up to 16 x 16 busy threads: the engine process took
54-98 CPU s to answer 1,024 images on /v1/embeddings (15 images per CPU second, 206-219 images/s against 547
offline; BENCHMARKS.md, fifteenth session). A thread pool of 8 preprocessing SigLIP images on this 2-core
machine used 1.4-1.8x the CPU per image with 2 intra-op threads than with 1.

So a process whose tower runs on an accelerator (or that runs no tower: a front end) runs torch's CPU ops
on one intra-op thread each; the parallelism is the pool's threads. A tower on the CPU keeps its threads
(its matmuls are the work there).
"""
import torch

from mmenc.logger import init_logger

logger = init_logger(__name__)


def one_intra_op_thread(tower_device: torch.device | str | None, where: str) -> bool:
    """torch.set_num_threads(1) unless the tower runs on this CPU (`tower_device` "cpu"); None: this process
    runs no tower (a front end). Call before the pool threads run torch ops (a thread keeps the team size it
    started with). Returns whether it changed the count."""
    if tower_device is not None and torch.device(tower_device).type == "cpu":
        return False
    before = torch.get_num_threads()
    if before == 1:
        return False
    torch.set_num_threads(1)
    logger.info("%s: torch's CPU ops on 1 intra-op thread (was %d): the pool threads are the parallelism",
                where, before)
    return True
