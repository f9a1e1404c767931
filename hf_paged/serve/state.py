"""The seam: the `GenerationState` transformers' handlers ask for a generation manager, answering with the Engine's."""

from __future__ import annotations

from transformers.cli.serving.utils import GenerationState, Modality

from .manager import EngineManager


class PagedGenerationState(GenerationState):
    """Every text request goes to one `EngineManager`; what needs transformers' sequential path instead (images,
    audio, `/v1/systemone`) is refused with HTTP 400."""

    def __init__(self, manager: EngineManager):
        super().__init__(continuous_batching=True)
        self.manager = manager

    def use_continuous_batching(self, model, modality) -> bool:
        # True: the handlers then tokenize to plain lists and leave the KV cache to the manager.
        return modality == Modality.LLM

    def get_manager(self, model_id: str, use_cb: bool = False) -> EngineManager:
        if not use_cb:
            from fastapi import HTTPException

            raise HTTPException(
                status_code=400,
                detail="hf-paged serve runs text generation only (chat completions, completions, responses) on a "
                "text model; this request needs transformers' own `transformers serve`",
            )
        return self.manager

    def is_cb_alive(self) -> bool:
        return self.manager.is_alive()

    def shutdown(self) -> None:
        self.manager.stop()
