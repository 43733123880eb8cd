"""An emulated Kubernetes API server for ConfigMaps, for tests and local runs.

`state` is the pure store (objects, resourceVersions, history, selectors); `server`
serves it over HTTP(S) on 127.0.0.1 with LIST, WATCH, CRUD, token auth and fault
injection. Typical use::

    async with open_emulator(token="t") as emu:
        emu.state.create_configmap("ns", "job-summary-a", {"outside-job-info": "true"}, {})
        ...  # point a client at emu.url
"""

from jobsignal.sim.emulator.server import (
    BOOKMARK_BEFORE_TIMEOUT,
    DEFAULT_WATCH_TIMEOUT,
    Drop,
    EmulatorStats,
    ExpireWatch,
    Fault,
    FaultQueue,
    HttpError,
    KubeEmulator,
    MalformedLine,
    RequestRecord,
    SplitLines,
    Stall,
    open_emulator,
    run_emulator,
)
from jobsignal.sim.emulator.state import (
    Change,
    ConfigMap,
    ConfigMapStore,
    FieldSelector,
    LabelSelector,
    ListOptions,
    ListPage,
    RawJson,
    Selector,
    StatusError,
    Subscription,
    filter_change,
)

__all__ = [
    "BOOKMARK_BEFORE_TIMEOUT",
    "DEFAULT_WATCH_TIMEOUT",
    "Change",
    "ConfigMap",
    "ConfigMapStore",
    "Drop",
    "EmulatorStats",
    "ExpireWatch",
    "Fault",
    "FaultQueue",
    "FieldSelector",
    "HttpError",
    "KubeEmulator",
    "LabelSelector",
    "ListOptions",
    "ListPage",
    "MalformedLine",
    "RawJson",
    "RequestRecord",
    "Selector",
    "SplitLines",
    "Stall",
    "StatusError",
    "Subscription",
    "filter_change",
    "open_emulator",
    "run_emulator",
]
