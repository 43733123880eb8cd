"""What importing and embedding jobsignal leaves of the host process: everything as it was.

In a fresh interpreter (this one has been through every other test), the
modules `import jobsignal` and its public names would load are imported first, so their own
import-time effects (trio-asyncio's on asyncio, say) happen before anything
is compared; then everything a library must not touch is recorded: every
module's namespace, `sys.modules`, the loggers (levels, handlers, filters),
the garbage collector's settings, signal handlers, warning filters and the
process-wide hooks. Then `import jobsignal` and its embedding entry points
(`jobsignal.serve` run on the demo cluster, `jobsignal.watch_jobs`,
`jobsignal.open_subscription`) are used, and the record taken again.

What jobsignal may add: its own modules, the modules of its dependencies it
imports, and its own loggers. What jobsignal's CLI does to its own process
(`gc.freeze()`, giving heap pages back, logging set up) is asked for
explicitly (`run_jobsignal(settle_memory=True)`) and tested here too.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.interpreter import report_of

ROOT = Path(__file__).resolve().parent.parent

# Prints the non-jobsignal modules that `import jobsignal` and its embedding entry
# points (imported on first use) load, in the order they were loaded: the program
# below imports them first, in that order, as an embedding program that already
# uses them would (trio_asyncio before grpclib: see jobsignal/rpc/__init__.py).
LOADED_BY_IMPORT = """
import json, sys
before = set(sys.modules)
import jobsignal
for name in jobsignal.__all__:  # every public name, each importing what it needs
    getattr(jobsignal, name)
print(json.dumps([
    name for name in list(sys.modules) if name not in before
    and name != "jobsignal" and not name.startswith("jobsignal.")
]))
"""

RECORD = '''
import gc, importlib, json, logging, signal, sys, threading, warnings

def namespaces():
    """Every module's attributes, by the identity of their values."""
    return {
        name: {key: id(value) for key, value in list(vars(module).items())}
        for name, module in list(sys.modules.items())
        if module is not None and not name.startswith("jobsignal") and name != "__main__"
    }

def loggers():
    found = {"": logging.getLogger()}
    found.update(
        (name, logger) for name, logger in logging.Logger.manager.loggerDict.items()
        if isinstance(logger, logging.Logger)
    )
    return {
        name: [logger.level, logger.disabled, logger.propagate,
               [id(h) for h in logger.handlers], [id(f) for f in logger.filters]]
        for name, logger in found.items()
    }

def settings():
    return {
        "gc": [gc.isenabled(), gc.get_threshold(), gc.get_debug(), gc.get_freeze_count()],
        "signals": {s.name: repr(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM)},
        "warnings": repr(warnings.filters),
        "hooks": [id(sys.excepthook), id(sys.unraisablehook), id(threading.excepthook),
                  id(sys.displayhook)],
        "recursion": sys.getrecursionlimit(),
        "switch": sys.getswitchinterval(),
        "logging": [logging.root.manager.disable, id(logging.lastResort),
                    logging.raiseExceptions, id(logging.getLoggerClass())],
    }

for name in json.loads(sys.argv[1]):
    importlib.import_module(name)

modules_before = {name: id(module) for name, module in sys.modules.items()}
namespaces_before, loggers_before, settings_before = namespaces(), loggers(), settings()

import jobsignal
import trio

async def embed():
    config = jobsignal.configure(listen="127.0.0.1:0", source="demo")
    async with trio.open_nursery() as nursery:
        server = await nursery.start(jobsignal.serve, config)
        with trio.fail_after(30):
            await server.ready.wait()
            options = jobsignal.SubscribeOptions("127.0.0.1", server.port, role="CCAgent")
            async with jobsignal.open_subscription(options):
                pass
        server.request_shutdown()
    async with jobsignal.watch_jobs(config) as events:
        pass

trio.run(embed)

changed_modules = sorted(
    name for name, ident in modules_before.items() if id(sys.modules.get(name)) != ident
)
# A module another package's name stands for that was not imported from its file.
planted = sorted(
    name for name, module in sys.modules.items()
    if name not in modules_before and not name.startswith("jobsignal")
    and module is not None and getattr(module, "__spec__", None) is None
    and name not in sys.builtin_module_names
)
namespaces_after = namespaces()
written = sorted(
    f"{name}.{key}"
    for name, before in namespaces_before.items()
    for key, ident in before.items()
    if namespaces_after.get(name, {}).get(key) != ident
    and f"{name}.{key}" not in set(sys.argv[2].split())
)
loggers_after = loggers()
loggers_changed = sorted(
    name for name, state in loggers_before.items() if loggers_after.get(name) != state
)
# Loggers made since (jobsignal's, httpcore's on first use) are at logging's defaults.
configured_loggers = sorted(
    name for name, state in loggers_after.items()
    if name not in loggers_before and state != [0, False, True, [], []]
)
settings_after = settings()
print(json.dumps({
    "changed_modules": changed_modules,
    "planted": planted,
    "written": written,
    "loggers_changed": loggers_changed,
    "configured_loggers": configured_loggers,
    "settings": [k for k in settings_before if settings_before[k] != settings_after[k]],
}))
'''


# Caches that a module fills in its own namespace on first use, whoever uses it.
LAZY_CACHES = [
    "httpx._transports.default.HTTPCORE_EXC_MAP",  # httpx's first transport
    "urllib.parse._hextobyte",  # unquote's first call
    "urllib.parse._hostprog",
    "urllib.parse._typeprog",
]


def test_importing_and_embedding_jobsignal_leaves_the_process_as_it_was() -> None:
    dependencies = report_of(LOADED_BY_IMPORT)
    assert "trio_asyncio" in dependencies and "grpclib" in dependencies  # (what is compared)
    report = report_of(RECORD, json.dumps(dependencies), " ".join(LAZY_CACHES))
    assert report == {
        "changed_modules": [],
        "planted": [],
        "written": [],
        "loggers_changed": [],
        "configured_loggers": [],
        "settings": [],
    }
