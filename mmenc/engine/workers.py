"""The worker-process group lives in mmenc.parallel.workers; this module keeps the older spelling
`WorkerGroup(world_size, tower_args, ...)` (the tower as `build_tower`'s arguments) importable."""
from mmenc.engine.runner import TowerRecipe
from mmenc.parallel import workers as _workers
from mmenc.parallel.workers import WorkerError

__all__ = ["WorkerError", "WorkerGroup"]


class WorkerGroup(_workers.WorkerGroup):
    """mmenc.parallel.WorkerGroup with `tower_args` (a dict of build_tower's arguments) or a TowerRecipe."""

    def __init__(self, world_size: int, tower_args, *args, **kwargs):
        recipe = TowerRecipe(dict(tower_args)) if isinstance(tower_args, dict) else tower_args
        super().__init__(world_size, recipe, *args, **kwargs)
