"""One logged warning per fallback reason (a kernel that cannot serve a call)."""

import logging

_warned: set[str] = set()


def warn_once(logger: logging.Logger, key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)
