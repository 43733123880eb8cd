"""Contract tests of jobsignal's adapter around grpclib (jobsignal/rpc/_grpclib.py)."""

from __future__ import annotations

import asyncio

import grpclib.utils
import trio
import trio_asyncio

import jobsignal  # noqa: F401  (importing jobsignal installs the adapter)


def test_grpclib_looks_up_the_current_task_through_trio_asyncio() -> None:
    # On Python 3.12+ the C `current_task` grpclib captured at import cannot see
    # trio-asyncio's loop; every handler and call would fail with UNKNOWN.
    assert grpclib.utils._current_task is asyncio.current_task


async def test_grpclib_wrappers_work_inside_a_trio_asyncio_task() -> None:
    async def enter_wrapper() -> bool:
        wrapper = grpclib.utils.Wrapper()
        with wrapper:
            await asyncio.sleep(0)
        return True

    async with trio_asyncio.open_loop():
        assert await trio_asyncio.aio_as_trio(enter_wrapper)()
    await trio.lowlevel.checkpoint()


async def test_every_grpclib_internal_the_adapter_uses_exists() -> None:
    """A grpclib or h2 upgrade that renames one of these fails here, by name."""
    import grpclib.protocol
    import grpclib.server
    import h2.connection
    import h2.settings

    server_attrs = ["_protocol_factory", "_server", "_server_closed_fut", "_handlers"]
    async with trio_asyncio.open_loop():  # Server() reads the current loop
        server = grpclib.server.Server([])
    for name in server_attrs:
        assert hasattr(server, name), f"grpclib Server.{name}"
    stream_attrs = ["_stream", "_codec", "_send_initial_metadata_done", "_send_message_done"]
    source = grpclib.server.Stream.__init__.__code__.co_names
    for name in stream_attrs:
        assert name in source or hasattr(grpclib.server.Stream, name), f"Stream.{name}"
    protocol_stream = grpclib.protocol.Stream.__init__.__code__.co_names
    for name in ["_h2_connection", "_transport", "connection", "id"]:
        assert name in protocol_stream or hasattr(grpclib.protocol.Stream, name), name
    processor_methods = ["register", "process", "process_stream_reset", "close"]
    for name in processor_methods:
        assert callable(getattr(grpclib.protocol.EventsProcessor, name)), name
    assert "processors" in grpclib.protocol.EventsProcessor.__init__.__code__.co_names
    assert "_tasks" in grpclib.server.Handler.__init__.__code__.co_names
    connection = h2.connection.H2Connection()
    assert isinstance(connection.local_settings._settings, dict)
    assert h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS in connection.local_settings._settings
    for name in ["send_data", "send_headers", "reset_stream", "close_connection", "streams"]:
        assert hasattr(connection, name), f"H2Connection.{name}"
