"""A verl interaction, unchanged: a simulated user checks the last assistant answer."""

from typing import Any
from uuid import uuid4

from verl.interactions.base import BaseInteraction


class GuessInteraction(BaseInteraction):
    def __init__(self, config: dict):
        super().__init__(config)
        self._instance_dict = {}

    async def start_interaction(self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs) -> str:
        if instance_id is None:
            instance_id = str(uuid4())
        self._instance_dict[instance_id] = {"ground_truth": ground_truth}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs):
        content = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
        if content.strip() == self._instance_dict[instance_id]["ground_truth"]:
            return True, "Correct!", 1.0, {}
        return False, "Wrong, try again.", 0.0, {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
