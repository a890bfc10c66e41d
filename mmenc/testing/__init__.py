"""Test and benchmark tooling, not part of the runtime: tiny random-weight checkpoints written with
transformers (`mmenc.testing.checkpoints`), the per-family table the generic tower tests read, and
helpers to compare tower outputs. Importing it needs only torch; transformers is imported on use."""


def version_before(version: str, minimum: str) -> bool:
    """Whether a package version ("2.11.0+cu130", "5.17.0") is older than `minimum` ("2.13", "5.24"),
    comparing the release numbers `minimum` names (a local tag like "+cu130" is ignored)."""
    def release(v: str, n: int) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split("+")[0].split(".")[:n])
    n = len(minimum.split("."))
    return release(version, n) < release(minimum, n)
