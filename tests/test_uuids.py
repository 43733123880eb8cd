"""jobsignal's UUIDs (jobsignal/util/uuids.py) are the standard library's, to the character."""

from __future__ import annotations

import random
import uuid

from jobsignal.util.uuids import name_uuid, random_uuid


def test_name_uuids_are_uuid5() -> None:
    rng = random.Random(5)
    for _ in range(2000):
        namespace = uuid.UUID(bytes=rng.randbytes(16))
        name = "".join(
            chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x3000)]))
            for _ in range(rng.randrange(0, 40))
        )
        assert name_uuid(namespace.bytes, name) == str(uuid.uuid5(namespace, name))
    assert (
        name_uuid(uuid.NAMESPACE_DNS.bytes, "python.org") == "886313e1-3b8a-5372-9b90-0c9aee199e5d"
    )


def test_random_uuids_are_uuid4_and_differ() -> None:
    made = {random_uuid() for _ in range(1000)}
    assert len(made) == 1000
    for text in made:
        value = uuid.UUID(text)
        assert str(value) == text
        assert (value.version, value.variant) == (4, uuid.RFC_4122)
