"""llmkit."""

import logging


class _DropHubKernelNotice(logging.Filter):
    """bitsandbytes (CPU, AVX512-BF16) warns on import that it cannot fetch an optional kernel from
    the Hugging Face hub via the ``kernels`` package. llmkit never downloads at run time and
    bitsandbytes falls back to its own CPU kernel, so the line is noise on every command."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in str(record.msg)


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropHubKernelNotice())
