"""The JSON log format: one object per line, a record's `extra` fields as keys.

Imported by `logs.configure_logging` only for `--log-format json`, so text
logs never load python-json-logger.
"""

from __future__ import annotations

import logging
from typing import Any

from pythonjsonlogger.json import JsonFormatter as _LibraryJsonFormatter

from jobsignal.logs import utc_timestamp


class JsonFormatter(_LibraryJsonFormatter):
    """One JSON object per line: `time`, `level`, `logger`, `message`, the record's
    `extra` fields as keys, and `error` (the traceback) when there is one."""

    def __init__(self) -> None:
        super().__init__(
            "%(message)s",
            rename_fields={"exc_info": "error", "stack_info": "stack"},
            json_ensure_ascii=False,
        )

    def add_fields(
        self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        envelope = {
            "time": utc_timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        log_data.update(envelope)  # first in every line
        super().add_fields(log_data, record, message_dict)
        log_data.update(envelope)  # and never replaced by an `extra` field of the same name
