"""What the reference service's servicer needs of an engine; requests and results are services.common's
(`SequenceBatch` in, log-prob rows out), shared with the trainer's ComputeLogProbs."""

from __future__ import annotations

from typing import Any, Protocol, Sequence


class LogProbEngine(Protocol):
    """Log-probs of a frozen model; services.reference.engine.ReferenceEngine is the torch one."""

    # The model served, reported by GetInfo.
    model_path: str

    async def logprobs(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                       temperature: float = 1.0, *, as_arrays: bool = False) -> list[Any]:
        """Log-prob of every response token given its prompt: rows as lists, or float32 arrays with as_arrays."""
        ...

    def info(self) -> dict[str, Any]:
        """Details for GetInfo (dtype, device, calls served, ...)."""
        ...
