//go:build linux

package kvsvc

import (
	"fmt"
	"os"
	"runtime"
	"syscall"
	"unsafe"
)

// Linux constants the syscall package lacks (golang.org/x/sys/unix has them;
// this package uses only the standard library beyond gRPC and protobuf).
const (
	mfdCloexec       = 0x1
	mfdAllowSealing  = 0x2
	fAddSeals        = 1033
	fSealSeal        = 0x1
	fSealShrink      = 0x2
	fSealGrow        = 0x4
	sealedMemfdSeals = fSealSeal | fSealShrink | fSealGrow
)

// sysMemfdCreate is memfd_create's number on each architecture Go supports.
var sysMemfdCreate = map[string]uintptr{
	"386": 356, "amd64": 319, "arm": 385, "arm64": 279, "loong64": 279,
	"mips": 4354, "mipsle": 4354, "mips64": 5314, "mips64le": 5314,
	"ppc64": 360, "ppc64le": 360, "riscv64": 279, "s390x": 350,
}

// MakeSealedMemfd makes a memfd of size bytes whose size is sealed
// (F_SEAL_SHRINK, F_SEAL_GROW and F_SEAL_SEAL): what RegisterMemfd's server
// requires, as fdpass.make_sealed_memfd makes it. The fd is close-on-exec;
// map it with syscall.Mmap(fd, 0, int(size), PROT_READ|PROT_WRITE, MAP_SHARED)
// and close it when done.
func MakeSealedMemfd(name string, size int64) (int, error) {
	fd, err := memfdCreate(name, mfdCloexec|mfdAllowSealing)
	if err != nil {
		return -1, err
	}
	if err := syscall.Ftruncate(fd, size); err != nil {
		syscall.Close(fd)
		return -1, os.NewSyscallError("ftruncate", err)
	}
	if _, _, errno := syscall.Syscall(syscall.SYS_FCNTL, uintptr(fd), fAddSeals, sealedMemfdSeals); errno != 0 {
		syscall.Close(fd)
		return -1, os.NewSyscallError("fcntl F_ADD_SEALS", errno)
	}
	return fd, nil
}

// memfdCreate is memfd_create(2).
func memfdCreate(name string, flags uintptr) (int, error) {
	nr, ok := sysMemfdCreate[runtime.GOARCH]
	if !ok {
		return -1, fmt.Errorf("memfd_create: no syscall number known for %s: %w", runtime.GOARCH, syscall.ENOSYS)
	}
	p, err := syscall.BytePtrFromString(name)
	if err != nil {
		return -1, fmt.Errorf("memfd_create: name %q: %w", name, err)
	}
	fd, _, errno := syscall.Syscall(nr, uintptr(unsafe.Pointer(p)), flags, 0)
	if errno != 0 {
		return -1, os.NewSyscallError("memfd_create", errno)
	}
	return int(fd), nil
}
