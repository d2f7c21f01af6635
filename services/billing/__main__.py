"""`python -m services.billing`: the billing consumer service.

Reads `BATON_DATABASE_URL`, `BATON_KAFKA_BOOTSTRAP` and the billing settings (this is the only place
the billing service reads the environment), applies the schema migrations (safe beside a starting
gateway: they take an advisory lock), and consumes until SIGTERM or SIGINT, which finish the batch in
hand and leave the consumer group cleanly.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType

from prometheus_client import start_http_server
from pydantic import ValidationError

from services.billing.consumer import ConsumerConfig, UsageConsumer
from services.billing.ledger import UsageLedger
from services.billing.pricing import PriceTable
from services.billing.schema import migrate_billing
from services.common.errors import BatonError
from services.common.settings import BatonSettings
from services.common.tracing import setup_tracing

log = logging.getLogger("services.billing")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = BatonSettings()
        # OpenTelemetry's own variable (none | console | otlp): each written batch is a span.
        setup_tracing(os.environ.get("OTEL_TRACES_EXPORTER", "none"), "baton-billing")
        config = ConsumerConfig.from_settings(settings)
        migrate_billing(config.database_url)
        consumer = UsageConsumer(config, UsageLedger(PriceTable.from_settings(settings)))
    except (BatonError, ValidationError) as e:
        log.error("cannot start: %s", e)
        return 2
    if settings.billing_metrics_port is not None:
        start_http_server(settings.billing_metrics_port, addr="0.0.0.0")
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: finishing the current batch", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("billing consumer: topic %s on %s, group %s", config.topic.name, config.topic.bootstrap,
             config.group_id)
    consumer.run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
