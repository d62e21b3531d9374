#: Customers with a negotiated discount, in percent.
DISCOUNTS = {"initech": 10, "hooli": 5}


def discounted(amount_cents, customer):
    return amount_cents * (100 - DISCOUNTS.get(customer, 0)) // 100
