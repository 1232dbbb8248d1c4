def total(n):
    """Sum of 1..n."""
    return sum(range(1, n))
