"""The gateway's Postgres data layer: pool + migrations (pool.py, migrations.py, migrations/*.sql) and
one store per aggregate (accounts, api_keys, conversations). Usage rows are written by billing."""
