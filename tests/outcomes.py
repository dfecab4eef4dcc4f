"""Test helper: what a call did, as plain data a rank can return through run_ranks."""


def outcome(fn):
    """(exception type name, message), or ("ok", None) when fn raised nothing."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return "ok", None
