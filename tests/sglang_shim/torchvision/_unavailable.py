"""Names the shim does not implement resolve to a stand-in that raises when used."""


def unavailable(qualname: str):
    if qualname.rsplit(".", 1)[-1].startswith("__"):
        raise AttributeError(qualname)

    class Unavailable:
        def __init__(self, *args, **kwargs):
            raise NotImplementedError(f"{qualname} is not available in rltrain's CPU test shim")

        def __call__(self, *args, **kwargs):
            raise NotImplementedError(f"{qualname} is not available in rltrain's CPU test shim")

    Unavailable.__name__ = Unavailable.__qualname__ = qualname.rsplit(".", 1)[-1]
    return Unavailable
