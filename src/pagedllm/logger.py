"""The `pagedllm` logger: one concise line per event on stderr, like vLLM's."""
from __future__ import annotations

import logging
import sys

from pagedllm import envs

_FORMAT = "%(levelname)s %(asctime)s %(filename)s:%(lineno)d] %(message)s"


def configure_logging() -> None:
    """INFO and up to stderr, unless PAGEDLLM_CONFIGURE_LOGGING=0 (then the application's
    own logging config rules). PAGEDLLM_LOGGING_LEVEL picks the level."""
    logger = logging.getLogger("pagedllm")
    if not envs.PAGEDLLM_CONFIGURE_LOGGING or logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(envs.PAGEDLLM_LOGGING_LEVEL)
    logger.propagate = False
