"""Tenants: API keys, organisations, rate limits, budgets, retention, and the backends behind them."""
