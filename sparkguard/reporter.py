"""Placeholder reporter (logs only); replaced by the report branch."""
import logging
log = logging.getLogger("sparkguard.reporter")


class Reporter:
    def __init__(self, incidents_dir, journal="auto", journal_socket="/run/systemd/journal/socket"):
        pass

    def event(self, incident, event):
        log.warning("incident %s: %s: %s", incident["id"], event["event"], event["detail"])

    def finish(self, incident):
        log.warning("incident %s finished: %s", incident["id"], incident["summary"])

    def close(self, timeout=5.0):
        pass
