"""The ``wasibox microvm`` command and the microVM rows of ``wasibox doctor``."""

from __future__ import annotations

from tests.test_cli import wasibox_cli


def test_microvm_build_help_explains_itself() -> None:
    top = wasibox_cli("--help").stdout
    assert "microvm" in top
    build = wasibox_cli("microvm", "build", "--help").stdout
    for words in ("root", "debootstrap", "WASIBOX_MICROVM_PACKAGES", "--package", "TCG"):
        assert words in build


def test_microvm_build_refuses_non_debian_packages() -> None:
    done = wasibox_cli("microvm", "build", "--package", "curl")
    assert done.returncode == 2
    assert "Debian Python packages" in done.stderr


def test_doctor_reports_the_microvm() -> None:
    doctor = wasibox_cli("doctor")
    assert doctor.returncode == 0
    for field in ("qemu", "bubblewrap", "microvm image", "microvm accelerator",
                  "microvm emulation"):
        assert field in doctor.stdout
    # A "tcg" accelerator always says why KVM is not used, even when /dev/kvm is present.
    accelerator = next(line for line in doctor.stdout.splitlines()
                       if line.startswith("microvm accelerator"))
    if " tcg" in accelerator and "forced" not in accelerator:
        assert "/dev/kvm" in accelerator and any(
            reason in accelerator for reason in ("does not exist", "cannot open",
                                                 "did not boot under KVM")), accelerator
    emulation = next(line for line in doctor.stdout.splitlines()
                     if line.startswith("microvm emulation"))
    assert "allowed" in emulation and (emulation.endswith(" allowed")
                                       or "--allow-emulation" in emulation)


def test_run_backend_flag_is_offered() -> None:
    assert "--allow-emulation" in wasibox_cli("run", "--help").stdout
    done = wasibox_cli("run", "--backend", "wasm", "-c", "import numpy")
    assert done.returncode == 1
    assert "ModuleNotFoundError" in done.stderr
