"""Old path of ``llmadapt.launch.environments`` (before 0.2), kept for one release for adapters written against it.

New code imports from ``llmadapt.launch.environments``; nothing inside llmadapt imports this module."""

from llmadapt.compat import moved
from llmadapt.host import state_dir
from llmadapt.launch.environments import (
    create,
    env_dir,
    older_builds,
    process_env,
    prune,
    python_for,
    recipe,
    recipe_hash,
    status,
)

moved("llmadapt.environments", "llmadapt.launch.environments", __name__)

__all__ = ['create', 'status', 'python_for', 'process_env', 'env_dir', 'prune', 'older_builds', 'recipe', 'recipe_hash', 'state_dir']
