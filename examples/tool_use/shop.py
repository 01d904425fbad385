"""The tool of examples/tool_use: a function of one's own that the policy's code can call in the
sandbox (``env.tools: [examples.tool_use.shop:price]``). Its source is defined before each tool
call's code, so it must be self-contained."""


def price(item: str) -> int:
    """The price of one ``item`` in cents; a KeyError for an item the shop does not sell."""
    prices = {"pen": 120, "notebook": 350, "eraser": 45, "ruler": 90, "stapler": 780, "folder": 65}
    return prices[item]
