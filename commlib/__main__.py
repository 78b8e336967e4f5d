"""`python -m commlib`: every setting (COMMLIB_<NAME>, current value, meaning) and the algorithms."""
import commlib
from commlib import settings
from commlib.backends import registry


def main():
    registry()                       # backends declare their settings on import
    resolved = settings.Settings()
    print("settings (keyword argument of commlib.init, or environment variable):")
    for name, setting in sorted(settings.defined().items()):
        print(f"  {'COMMLIB_' + name.upper():<38} = {getattr(resolved, name)!r:<14} {setting.help}")
    print("\nalgorithms:", ", ".join(sorted(registry())), "(plus 'auto', and 'allgather' for compressed payloads)")
    print("policy text: pattern[min=..,max=..,dtype=..]=algorithm[:compressor]; ...   e.g.",
          repr("embedding.*=omnireduce;*.weight[min=1MiB]=topk(ratio=0.01);*=auto"))
    print(f"commlib {commlib.__file__}")


if __name__ == "__main__":
    main()
