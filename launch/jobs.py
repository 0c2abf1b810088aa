"""What a training job needs before it runs, for `hotloop train`, `hotloop eval`, `hotloop
demo` and the benchmarks that run jobs in-process: its typed sections, checked with the
whole file, and the running mesh it is pointed at.

A job gets the running mesh's addresses as a typed `MeshConfig` (`MeshInfo.apply`), never
through the environment. Does not own running the job (`services.trainer.runner`) or the
commands (`apps/train.py`).
"""

from __future__ import annotations


def load_job(config_path: str | None, overrides: list[str], algorithm: str, mesh=None):
    """The mesh and the job's (`algorithm`: a registered recipe's name, its section) and
    `[trainer]`'s sections, every section of the file checked at once; `mesh` (a running
    mesh's `MeshInfo`) points the mesh sections at it. The `[trainer]` values the recipe
    fixes win over the file's (`ppo`: the trainer's algorithm is PPO whatever the file says)."""
    return load_job_report(config_path, overrides, algorithm, mesh)[:3]


def load_job_report(config_path: str | None, overrides: list[str], algorithm: str, mesh=None):
    """`load_job`'s sections and `[report]` (the experiment trackers, `hotloop.tracking`)."""
    from hotloop.grpcutil import configure
    from services.trainer.recipes.registry import recipe

    from launch import sections

    fixed = dict(recipe(algorithm).trainer)
    patch = {"trainer": fixed} if fixed else None
    loaded = sections.load(config_path, overrides, patch)
    mesh_cfg = mesh.apply(loaded.mesh) if mesh is not None else loaded.mesh
    configure(mesh_cfg.grpc)  # the job's clients ping as the mesh's do
    return mesh_cfg, loaded[algorithm], loaded["trainer"], loaded["report"]


def running_mesh(run_dir: str):
    """The running mesh at `run_dir`, or None after saying why not."""
    from launch.mesh import MeshInfo

    try:
        return MeshInfo.load(run_dir)
    except FileNotFoundError as e:
        print(e)
        return None
