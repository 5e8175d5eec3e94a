from typing import Any

class Twin:
    taken: int
    def __init__(self, g: Any, step: Any) -> None: ...
