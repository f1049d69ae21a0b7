"""Page arithmetic the cache tests check the cache against."""


def ceil_div(a: int, b: int) -> int:
    """a / b rounded up: the pages that hold a tokens at b a page."""
    return -(-a // b)
