"""structlog, configured once per process by the entrypoint.

Every line carries the context bound with ``bind`` (run id, agent id, trajectory id...):
JSON lines to ``<run_dir>/coevo.log.jsonl``, readable (or JSON) lines on the console.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Literal

import structlog

_SHARED: list[Any] = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_logger_name,
    structlog.stdlib.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


def configure_logging(
    run_dir: Path | None,
    *,
    level: str = "info",
    console: Literal["pretty", "json", "off"] = "pretty",
    console_filter: logging.Filter | None = None,
) -> Path | None:
    """Route structlog (and stdlib logging) to a JSON-lines file and the console (``console_filter``: what
    of it the console shows, from the first record on; the file keeps everything)."""
    structlog.configure(
        processors=[*_SHARED, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    root.setLevel(level.upper())
    path: Path | None = None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "coevo.log.jsonl"
        fh = logging.FileHandler(path)
        fh.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                foreign_pre_chain=_SHARED,
                processors=[
                    structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer(),
                ],
            )
        )
        root.addHandler(fh)
    if console != "off":
        renderer: Any = (
            structlog.processors.JSONRenderer()
            if console == "json"
            else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        )
        ch = logging.StreamHandler(sys.stderr)
        ch.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                foreign_pre_chain=_SHARED,
                processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            )
        )
        if console_filter is not None:
            ch.addFilter(console_filter)
        root.addHandler(ch)
    # libraries that log each call at INFO (LiteLLM also through its own console handler): warnings and up
    for noisy in ("nats", "asyncio", "filelock", "urllib3", "httpx", "LiteLLM", "LiteLLM Router", "LiteLLM Proxy"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    return path


def bind(**ids: Any) -> None:
    """Bind ids to every log line of the current context (task)."""
    structlog.contextvars.bind_contextvars(**ids)
