"""A verl tool class exactly as a verl user writes it (imports from verl, unchanged)."""

from typing import Any
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.rollout_trace import rollout_trace_op


class CalcAnswerTool(BaseTool):
    """Records the model's answer; rewards it against the row's ground truth."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}
        self.released = []

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs):
        if instance_id is None:
            instance_id = str(uuid4())
        self._instance_dict[instance_id] = {"answer": None, "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        answer = str(parameters.get("answer", ""))
        state = self._instance_dict[instance_id]
        state["answer"] = answer
        reward = await self.calc_reward(instance_id)
        step = 0.0 if reward > state["reward"] else self.config.get("penalty", -0.05)
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed answer={answer!r} reward={reward}"), step, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return 1.0 if state["answer"] == state["ground_truth"] else 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        self.released.append(instance_id)
        del self._instance_dict[instance_id]
