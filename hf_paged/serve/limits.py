"""How long a request may be: the model's position limit and what one request can hold of the pool.

A prompt the model cannot position, or whose K/V the whole pool could never hold, is refused with HTTP 400 before it
reaches the Engine. A request that names no max_tokens gets all the room that is left; one that
names more than is left is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InvalidRequest

if TYPE_CHECKING:
    from ..engine import Engine


@dataclass(frozen=True)
class RequestLimits:
    """`max_model_len`: positions the model has (None: no limit in its config). `max_kv_tokens`: the most tokens of
    K/V one request can hold running alone in the pool (None: no limit below `max_model_len`, as when every layer
    slides)."""

    max_model_len: int | None
    max_kv_tokens: int | None
    num_blocks: int
    block_size: int

    @classmethod
    def for_engine(cls, engine: Engine, max_model_len: int | None = None) -> RequestLimits:
        """The Engine's limits; `max_model_len` (the server's `--max-model-len`) lowers the model's own."""
        positions = engine.limits.max_positions
        if max_model_len is not None:
            positions = max_model_len if positions is None else min(positions, max_model_len)
        return cls(positions, engine.max_pool_tokens, engine.pool.num_blocks, engine.pool.block_size)

    def max_new_tokens(
        self,
        num_prompt_tokens: int,
        max_new_tokens: int,
        given: bool,
        param: str,
        max_tokens_field: str = "max_tokens",
        prompt_only: bool = False,
    ) -> int:
        """The tokens a request with this prompt may generate: `max_new_tokens` when `given`, else all the room left
        before the model's position limit and what the pool holds of one request (`max_new_tokens` where neither
        limits it). Raises `InvalidRequest` for a prompt that leaves no room, or a `given` count above the room.
        `prompt_only`: the answer is the prompt alone (max_tokens 0 with echo), which may fill every position: 1, the
        token its Engine request samples from the last prompt position's logits and never feeds back."""
        if num_prompt_tokens == 0:
            raise InvalidRequest("the prompt is empty: a request needs at least one prompt token", param)
        rooms = []
        if self.max_model_len is not None:
            if num_prompt_tokens + (not prompt_only) > self.max_model_len:  # room for one generated token
                raise InvalidRequest(
                    f"the prompt has {num_prompt_tokens} tokens; this model's limit is {self.max_model_len} "
                    "positions (max_position_embeddings), prompt and generated tokens together",
                    param,
                )
            rooms.append((self.max_model_len - num_prompt_tokens, f"the model's limit of {self.max_model_len}"))
        if self.max_kv_tokens is not None:
            if num_prompt_tokens > self.max_kv_tokens:
                raise InvalidRequest(
                    f"the prompt has {num_prompt_tokens} tokens; the KV cache pool holds at most {self.max_kv_tokens} "
                    f"tokens of one request ({self.num_blocks} blocks of {self.block_size}): start the server with a "
                    "larger --max-memory",
                    param,
                )
            # The last generated token is never fed back: its K/V is not stored.
            rooms.append(
                (self.max_kv_tokens - num_prompt_tokens + 1, f"the {self.max_kv_tokens} tokens the pool holds")
            )
        if prompt_only:
            return 1
        if not rooms:
            return max_new_tokens
        room, limit = min(rooms)
        if given and max_new_tokens > room:
            raise InvalidRequest(
                f"{max_tokens_field} is {max_new_tokens}, but the prompt's {num_prompt_tokens} tokens leave room for "
                f"{room} within {limit}",
                max_tokens_field,
            )
        return min(max_new_tokens, room) if given else room
