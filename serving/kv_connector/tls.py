"""TLS for the tcp KV connector: stdlib `ssl`, certificates and keys from PEM files.

The handoff key (auth.py) already authenticates every handle and the per-handoff secret gates
the blocks, so without TLS nobody can forge or take a handoff; what TLS adds across hosts is
that the KV bytes and the handle's secret cannot be read or altered on the wire, and that the
generation side talks only to a context server holding a certificate its CA signed.

    context side (server)                      generation side (client)
    kv_tls_cert_file + kv_tls_key_file  ──▶    kv_tls_ca_file: the CA the context servers'
      its certificate (TLS on)                 certificates must chain to (TLS on); the name
    kv_tls_ca_file (optional): then every       in the handle's location (kv_advertise_host)
      client must present a certificate         must match the certificate
      this CA signed (mutual TLS)              kv_tls_cert_file + kv_tls_key_file (optional):
                                                its client certificate, for mutual TLS

Which side uses TLS is the configuration's choice, never the handle's: a generation engine with
a CA file speaks only TLS, so a client-sent handle cannot downgrade it. TLS 1.2 is the oldest
version either side accepts. A private key file must be this user's alone (mode 0600), like the
handoff key.
"""

from __future__ import annotations

import os
import ssl
import stat


class TlsConfigError(ValueError):
    """A TLS file is missing, unreadable, unsafe or not what it should be (the message says which)."""


def _check_file(path: str, what: str, private: bool = False) -> str:
    try:
        info = os.stat(path)
    except OSError as exc:
        raise TlsConfigError(f"{what} {path} cannot be read: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise TlsConfigError(f"{what} {path} is not a regular file")
    if private and info.st_mode & 0o077:
        raise TlsConfigError(f"{what} {path} is accessible to other users (mode "
                             f"{stat.S_IMODE(info.st_mode):04o}): `chmod 600 {path}`")
    return path


def _load_chain(context: ssl.SSLContext, cert_file: str, key_file: str | None) -> None:
    if not key_file:
        raise TlsConfigError("kv_tls_cert_file needs kv_tls_key_file (the certificate's private key)")
    _check_file(cert_file, "kv_tls_cert_file")
    _check_file(key_file, "kv_tls_key_file", private=True)
    try:
        context.load_cert_chain(cert_file, key_file)
    except (ssl.SSLError, OSError) as exc:
        raise TlsConfigError(f"kv_tls_cert_file {cert_file} / kv_tls_key_file {key_file} cannot be "
                             f"used: {exc} (PEM files, the key must belong to the certificate)") from None


def _load_ca(context: ssl.SSLContext, ca_file: str) -> None:
    _check_file(ca_file, "kv_tls_ca_file")
    try:
        context.load_verify_locations(cafile=ca_file)
    except (ssl.SSLError, OSError) as exc:
        raise TlsConfigError(f"kv_tls_ca_file {ca_file} cannot be used: {exc} (a PEM file of CA "
                             "certificates)") from None


def server_context(cert_file: str | None, key_file: str | None, ca_file: str | None) -> ssl.SSLContext | None:
    """The context side's TLS (None: plain TCP, when no certificate is configured)."""
    if not cert_file:
        if key_file or ca_file:
            raise TlsConfigError("the context model's kv_tls_key_file / kv_tls_ca_file need "
                                 "kv_tls_cert_file (its certificate): TLS is on when that is set")
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(context, cert_file, key_file)
    if ca_file:
        _load_ca(context, ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(ca_file: str | None, cert_file: str | None, key_file: str | None) -> ssl.SSLContext | None:
    """The generation side's TLS (None: plain TCP, when no CA is configured)."""
    if not ca_file:
        if cert_file or key_file:
            raise TlsConfigError("the generation model's kv_tls_cert_file / kv_tls_key_file need "
                                 "kv_tls_ca_file (the CA of the context servers' certificates): "
                                 "TLS is on when that is set")
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the certificate and the host name
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_ca(context, ca_file)
    if cert_file:
        _load_chain(context, cert_file, key_file)
    return context
