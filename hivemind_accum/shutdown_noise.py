"""
A logging filter for one kind of hivemind 1.1.12 shutdown noise: ``DHT.run`` logging, with a traceback, a request
whose sending process has exited.

``DHT.run`` unpickles each request it reads. A request carries an ``MPFuture`` and the future its sender's pipe. Python
fetches that pipe's file descriptor from the sender through ``multiprocessing.resource_sharer``, over a Unix socket the
sender removes when it exits. When the sender has already exited, this raises ``FileNotFoundError`` ([Errno 2]),
``ConnectionRefusedError`` or ``ConnectionResetError``, and hivemind logs ``[ERROR] [hivemind.dht.dht._run:130]`` and
drops the request. Nothing else is lost: no process waits for the request's result (docs/upstream.md, "Shutdown noise").
"""
import logging
import multiprocessing
import os
import traceback
import warnings

DHT_LOGGER = "hivemind.dht.dht"
_SENDER_GONE = (FileNotFoundError, ConnectionRefusedError, ConnectionResetError)
_RESOURCE_SHARER = os.path.join("multiprocessing", "resource_sharer.py")


class ExitedSenderFilter(logging.Filter):
    """Drops ``DHT.run``'s error for a request whose sender has exited; passes every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.funcName != "_run" or not record.exc_info or not isinstance(record.exc_info[1], _SENDER_GONE):
            return True
        frames = traceback.extract_tb(record.exc_info[2])
        return not any(frame.filename.endswith(_RESOURCE_SHARER) for frame in frames)


def silence_exited_sender_errors() -> None:
    """
    Add :class:`ExitedSenderFilter` to hivemind's DHT logger (once). Call it before starting a DHT: the DHT's process
    is forked and inherits the filter; a DHT already running keeps logging these errors (a warning says so).
    """
    from hivemind import DHT

    running = sum(isinstance(process, DHT) for process in multiprocessing.active_children())
    if running:
        warnings.warn(f"silence_exited_sender_errors(): {running} DHT(s) already started keep logging these errors; "
                      f"call it before DHT(start=True)", stacklevel=2)
    logger = logging.getLogger(DHT_LOGGER)
    if not any(isinstance(f, ExitedSenderFilter) for f in logger.filters):
        logger.addFilter(ExitedSenderFilter())
