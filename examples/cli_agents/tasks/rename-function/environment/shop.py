def calc(prices):
    return sum(prices)


def receipt(prices):
    return f"total: {calc(prices)}"
