"""The keys of the job's data plane (switchml and omnireduce packets), seen from a rank.

Every data packet and every result of a job carries a MAC under the job key (ChaCha20-Poly1305
in switch/csrc), derived from the daemon key of the switch or aggregator and the job's public nonce
(switch/auth.py). The daemon key never crosses the network in clear:

- daemons a rank starts (the embedded switch, colocated or spawned aggregators) take the job's
  secret, which rank 0 drew and shared through the launcher's broadcast (commlib.bootstrap);
- a daemon started on its own reads its key file, and so do the ranks (`key_file`).

The daemon derives the same job key from the nonce in the registration.
"""
from commlib.errors import ConfigError
from commlib.settings import define
from commlib.switch import auth

define("authenticate", True, "MAC every switchml/omnireduce data packet and result under a per-job key "
       "(ChaCha20-Poly1305); off only on a trusted fabric (saves the MAC's cost, see benchmarks/RESULTS.md)")


def daemon_key(ctx, embedded, key_file="", setting="", daemon="daemon"):
    """The key of the daemon this rank talks to: the job's secret for one the job started itself,
    else the key file's (`setting` names it). Without one the job's packets would carry no MACs:
    refused unless `authenticate` is off (a trusted fabric), so no job runs unauthenticated silently."""
    if embedded:
        return ctx.secret or None
    if key_file:
        return auth.read_key(key_file)
    if ctx.settings.authenticate:
        raise ConfigError(auth.unauthenticated(daemon, f"no key file (COMMLIB_{setting.upper()}) names its key"))
    return None


def job_key(ctx, key, nonce):
    """The job key (bytes) its packets are authenticated with, or None when they are not."""
    if not ctx.settings.authenticate or key is None:
        return None
    return auth.job_key(key, nonce)
