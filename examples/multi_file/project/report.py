"""The untrusted project's entry point: it imports its own modules from the mount."""

from pricing import rules
from pricing.money import cents


def report(rows):
    """Per-customer totals of the orders, with the project's own discount rules."""
    totals = {}
    for row in rows:
        amount = rules.discounted(cents(row["unit_price"]) * int(row["qty"]), row["customer"])
        totals[row["customer"]] = totals.get(row["customer"], 0) + amount
    return {name: f"{total / 100:.2f}" for name, total in sorted(totals.items())}
