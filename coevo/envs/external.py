"""Family ``external`` without a pool: the environment is a program outside coevo.

Its agents talk to the policy endpoint (``coevo.serve``) and bring their own tasks (``POST
/coevo/v1/episodes`` with ``{"task_id", "goal"}``); coevo never steps such an environment itself.
With ``env.tasks_from`` set, ``make_family`` returns that family instead (its pool is handed out).
"""

from __future__ import annotations

from coevo.envs.base import Environment, Family, PrecheckResult
from coevo.errors import EnvError
from coevo.schemas import TaskSpec


class ExternalFamily(Family):
    name = "external"
    max_steps_cap = 1000

    def make_env(self) -> Environment:
        raise EnvError("family external: the environment runs outside coevo (its agent calls the policy endpoint)")

    def initial_tasks(self, n_train: int, n_heldout: int, seed: int) -> list[TaskSpec]:
        return []

    async def precheck(self, task: TaskSpec) -> PrecheckResult:
        return PrecheckResult(True, "an external task: nothing to check here")
