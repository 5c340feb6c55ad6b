"""SMITH's pieces: the sandbox, the tool format (:class:`ToolSpec`), the tool pool (:class:`ToolPool`) and the
procedural task suite (:mod:`llmkit.tools.tasks`).

    from llmkit.tools import sandbox, ToolSpec, ToolPool
    from llmkit.tools import tasks
"""

from llmkit.tools import sandbox

__all__ = ["ToolPool", "ToolSpec", "sandbox", "tasks"]


def __getattr__(name):
    if name == "ToolSpec":
        from llmkit.tools.spec import ToolSpec

        return ToolSpec
    if name == "ToolPool":
        from llmkit.tools.pool import ToolPool

        return ToolPool
    if name == "tasks":
        import importlib

        return importlib.import_module("llmkit.tools.tasks")
    raise AttributeError(name)
