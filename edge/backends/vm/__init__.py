"""The vm backend: full VMs on libvirt/QEMU (issue 33), with a screen for computer use."""
