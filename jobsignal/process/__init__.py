"""The server process's own resources: its file-descriptor limit, the C heap's free
pages, the garbage collector's pauses. They act on the whole process, so only the
command line's server uses them unasked; an embedding program opts in."""
