"""What every route of the server shares: the engine, its driver, the scorer, the tokenizer and the limits."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ulorl_jax.decode.engine import PolicyEngine
from ulorl_jax.serving.driver import EngineDriver
from ulorl_jax.serving.protocol import Limits
from ulorl_jax.serving.scoring import Scorer


@dataclasses.dataclass
class ServingState:
    engine: PolicyEngine
    driver: EngineDriver
    scorer: Scorer
    tokenizer: Any
    limits: Limits
    served_name: str
    root: str  # where the model came from (GET /v1/models)
    api_key: str | None = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
