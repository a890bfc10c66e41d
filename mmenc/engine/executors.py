"""Where an Encoder runs its tower: the one executor object, chosen once at construction:

    InProcessExecutor    the tower in this process (one device)
    WorkerGroupExecutor  N worker processes the Encoder owns (tensor_parallel_size > 1)
    TorchrunExecutor     this process is one rank of a torchrun launch (RANK/WORLD_SIZE set)

Every executor: `run(pixel_values [P, F], grid_thw int64 [N >= 1, 3]) -> TowerOutput` (image order, on
`device`), `loaded` (a LoadedTower; for workers its tower is a meta-device copy for shapes),
`device`, `input_device` (where pixel_values should be for `run`: the Encoder's Preprocessor finishes
them there), `tensor_parallel_size`, `mode`, `launches_asynchronously` (run returns once the kernels
are queued: only the tower in this process), `attention_backends()`, `close()`. Calls are not
re-entrant: the Encoder holds one lock around each whole call (see docs/engine.md, Threads).
"""
import torch

from mmenc.engine.tower import LoadedTower, TowerRecipe, build_tower, run_tower
from mmenc.logger import init_logger
from mmenc.models.base import TowerOutput
from mmenc.parallel import WorkerGroup, build_rank_tower, check_same_call, run_rank_tower

logger = init_logger(__name__)


def tower_backends(loaded: LoadedTower) -> str:
    """The attention backend(s) the tower's layers chose, e.g. "TORCH_SDPA"."""
    from mmenc.attention.layer import MMEncoderAttention

    names = sorted({m.describe_backend() for m in loaded.tower.modules() if isinstance(m, MMEncoderAttention)})
    return ", ".join(names)


class InProcessExecutor:
    """The tower built in this process on `device`."""

    mode = "weights"
    tensor_parallel_size = 1
    launches_asynchronously = True

    def __init__(self, recipe: TowerRecipe, device: torch.device):
        self.loaded = build_tower(**{**recipe.tower_args, "device": device})
        self.device = self.input_device = device

    def run(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        return run_tower(self.loaded, pixel_values, grid_thw)

    def attention_backends(self) -> str:
        return tower_backends(self.loaded)

    def close(self) -> None:
        pass


class WorkerGroupExecutor:
    """`world_size` worker processes (mmenc.parallel.WorkerGroup) that hold the tower; results come
    back on `device`."""

    launches_asynchronously = False

    def __init__(self, recipe: TowerRecipe, device: torch.device, world_size: int, mode: str, timeout_s: float):
        self.group = WorkerGroup(world_size, recipe, mode=mode, device_type=device.type, output_device=device,
                                 timeout_s=timeout_s)
        self.device, self.tensor_parallel_size, self.mode = device, world_size, self.group.mode
        self.input_device = torch.device("cpu")  # the group stages host pixels to its GPUs itself
        self.loaded = self.group.describe()
        # the workers hold the weights; a tower on the meta device (no memory) answers shape questions
        self.loaded.tower = TowerRecipe({**recipe.tower_args, "dtype": self.loaded.dtype}).meta_tower().tower

    def run(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        return self.group.run(pixel_values, grid_thw)

    def attention_backends(self) -> str:
        return getattr(self.loaded, "attention_backends", None) or tower_backends(self.loaded)

    def close(self) -> None:
        self.group.close()


class TorchrunExecutor:
    """This process is one rank of a launch (torchrun): every rank builds the Encoder and calls it
    with the same inputs in the same order; every rank receives the full result. Each call first
    checks that all ranks hold the same call (`check_same_call`) and raises on every rank if not."""

    launches_asynchronously = False

    def __init__(self, recipe: TowerRecipe, env, tensor_parallel_size: int, mode: str):
        if tensor_parallel_size not in (1, env.world_size):
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} but torchrun started {env.world_size} "
                             f"processes; pass {env.world_size} (or leave it at 1) under torchrun")
        self.mode, reason = recipe.tp_mode(mode, env.world_size)
        if reason:
            logger.warning("%s", reason)
        self.recipe, self.device, self.tensor_parallel_size = recipe, env.device, env.world_size
        self.input_device = env.device
        self.loaded = build_rank_tower(recipe, self.mode, env.device)

    def run(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        check_same_call(pixel_values, grid_thw, self.device)
        with torch.inference_mode():
            return run_rank_tower(self.recipe, self.loaded, pixel_values, grid_thw, self.mode)

    def attention_backends(self) -> str:
        return tower_backends(self.loaded)

    def close(self) -> None:
        pass


def make_executor(recipe: TowerRecipe, device: torch.device | None, tensor_parallel_size: int, mode: str,
                worker_timeout_s: float):
    """TorchrunExecutor when launched distributed, WorkerGroupExecutor for tensor_parallel_size > 1,
    else InProcessExecutor. `device` None: the platform's (under torchrun: this rank's)."""
    from mmenc.distributed import init_from_env
    from mmenc.engine.tower import default_device

    env = init_from_env(device_type=device.type if device is not None else None)
    if env is not None and env.world_size > 1:
        return TorchrunExecutor(recipe, env, tensor_parallel_size, mode)
    device = device if device is not None else default_device()
    if tensor_parallel_size > 1:
        return WorkerGroupExecutor(recipe, device, tensor_parallel_size, mode, worker_timeout_s)
    return InProcessExecutor(recipe, device)
