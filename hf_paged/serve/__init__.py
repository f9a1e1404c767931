"""`hf-paged serve`: the Engine as the generation backend of transformers' OpenAI-compatible server.

transformers' handlers ask a `GenerationState` for a generation manager; `PagedGenerationState` answers with an
`EngineManager`, which runs one Engine on one thread (`manager.py` draws how requests travel). Nothing below this
package imports it; transformers' serving modules load only when a server starts, after `compat.check_seams`.
"""

from .cli import main

__all__ = ["main"]
