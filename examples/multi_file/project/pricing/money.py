from decimal import Decimal


def cents(text):
    return int(Decimal(text) * 100)
