"""Guest code under test: parses "key=value;key=value" settings strings."""


def parse_pairs(text: str) -> dict:
    pairs = {}
    for item in filter(None, text.split(";")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"not a key=value pair: {item!r}")
        pairs[key.strip()] = value.strip()
    return pairs


def accepts(text: str) -> bool:
    """Whether ``text`` parses; any exception but ValueError is a bug."""
    try:
        parse_pairs(text)
    except ValueError:
        return False
    return True
