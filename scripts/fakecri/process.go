package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"
)

// launch is what StartContainer runs for a created container.
type launch struct {
	argv    []string
	env     []string
	dir     string
	logPath string
}

// process is a started container: its first process and everything that shares its mount
// namespace. Each container gets a mount namespace of its own (a copy of the node's), which its
// descendants keep whatever they do (setsid, double fork, a dead parent), so the namespace tells
// exactly which processes are the container's.
type process struct {
	pid int
	// ns is the namespace's link text ("mnt:[4026532512]"); nsFile keeps the namespace, and so
	// that inode number, from being reused while the container is known.
	ns     string
	nsFile *os.File
	exited chan struct{} // closed once pid is reaped
}

// startProcess runs l as a new session in a new mount namespace, its stdout and stderr going to
// l.logPath in the CRI log format. The caller holds the lock under which children are reaped, so
// the process cannot be reaped (and its namespace vanish) before it is known.
func startProcess(l launch) (*process, error) {
	if len(l.argv) == 0 {
		return nil, errors.New("the container has no command (images are not run: give the pod a command)")
	}
	path, err := exec.LookPath(l.argv[0])
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(l.logPath), 0o755); err != nil {
		return nil, err
	}
	logFile, err := os.OpenFile(l.logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o640)
	if err != nil {
		return nil, err
	}
	devNull, err := os.Open(os.DevNull)
	if err != nil {
		_ = logFile.Close()
		return nil, err
	}
	defer devNull.Close()
	outR, outW, err := os.Pipe()
	if err != nil {
		_ = logFile.Close()
		return nil, err
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		_ = logFile.Close()
		_, _ = outR.Close(), outW.Close()
		return nil, err
	}
	pid, err := syscall.ForkExec(path, l.argv, &syscall.ProcAttr{
		Dir:   l.dir,
		Env:   l.env,
		Files: []uintptr{devNull.Fd(), outW.Fd(), errW.Fd()},
		Sys:   &syscall.SysProcAttr{Setsid: true, Unshareflags: syscall.CLONE_NEWNS},
	})
	_, _ = outW.Close(), errW.Close()
	if err != nil {
		_ = logFile.Close()
		_, _ = outR.Close(), errR.Close()
		return nil, fmt.Errorf("starting %s: %w", path, err)
	}
	p := &process{pid: pid, exited: make(chan struct{})}
	// A process that already exited has no namespace link: then nothing of it is left to track.
	nsPath := fmt.Sprintf("/proc/%d/ns/mnt", pid)
	if f, err := os.Open(nsPath); err == nil {
		p.nsFile = f
		p.ns, _ = os.Readlink(nsPath)
	}
	var mu sync.Mutex
	var copying sync.WaitGroup
	for stream, r := range map[string]*os.File{"stdout": outR, "stderr": errR} {
		copying.Go(func() {
			copyLog(logFile, &mu, stream, r, time.Now)
			_ = r.Close()
		})
	}
	go func() {
		copying.Wait()
		_ = logFile.Close()
	}()
	return p, nil
}

// copyLog writes each line of r to w as kubelet reads container logs: "<RFC3339Nano time>
// <stream> F <line>", a line longer than the buffer in "P" (partial) pieces.
func copyLog(w io.Writer, mu *sync.Mutex, stream string, r io.Reader, now func() time.Time) {
	reader := bufio.NewReaderSize(r, 16*1024)
	for {
		line, err := reader.ReadSlice('\n')
		tag := "F"
		if errors.Is(err, bufio.ErrBufferFull) {
			tag = "P"
		} else if len(line) > 0 && line[len(line)-1] == '\n' {
			line = line[:len(line)-1]
		}
		if len(line) > 0 || err == nil {
			entry := fmt.Sprintf("%s %s %s %s\n", now().UTC().Format(time.RFC3339Nano), stream, tag, line)
			mu.Lock()
			_, _ = io.WriteString(w, entry)
			mu.Unlock()
		}
		if err != nil && !errors.Is(err, bufio.ErrBufferFull) {
			return
		}
	}
}

// members are the live processes of the container.
func (p *process) members() []int {
	if p.ns == "" {
		return nil
	}
	entries, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", pid)); err == nil && ns == p.ns {
			pids = append(pids, pid)
		}
	}
	return pids
}

func (p *process) signal(sig syscall.Signal) {
	for _, pid := range p.members() {
		_ = syscall.Kill(pid, sig)
	}
}

// stop sends SIGTERM to every process of the container, SIGKILL to what is left after grace, and
// returns once none is left (or after 10 s more) and the first one is reaped.
func (p *process) stop(grace time.Duration) {
	p.signal(syscall.SIGTERM)
	deadline := time.Now().Add(grace)
	for len(p.members()) > 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	p.kill()
}

func (p *process) kill() {
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if len(p.members()) == 0 {
			break
		}
		p.signal(syscall.SIGKILL)
		time.Sleep(20 * time.Millisecond)
	}
	select {
	case <-p.exited:
	case <-time.After(time.Until(deadline)):
	}
}

// release lets the namespace go once the container is removed.
func (p *process) release() {
	if p.nsFile != nil {
		_ = p.nsFile.Close()
	}
}

// exitCode is what a runtime reports for a wait status: the code, or 128 + the killing signal.
func exitCode(ws syscall.WaitStatus) int32 {
	if ws.Signaled() {
		return 128 + int32(ws.Signal())
	}
	return int32(ws.ExitStatus())
}

// nthAddress is the n-th address of prefix (an IPv4 network: the network address is the 0th).
func nthAddress(prefix netip.Prefix, n uint64) (netip.Addr, error) {
	if !prefix.Addr().Is4() {
		return netip.Addr{}, fmt.Errorf("%s is not an IPv4 range", prefix)
	}
	size := uint64(1) << (32 - prefix.Bits())
	if n == 0 || n >= size-1 {
		return netip.Addr{}, fmt.Errorf("no address %d in %s: the range is used up", n, prefix)
	}
	base := prefix.Masked().Addr().As4()
	value := uint64(base[0])<<24 | uint64(base[1])<<16 | uint64(base[2])<<8 | uint64(base[3]) + n
	return netip.AddrFrom4([4]byte{byte(value >> 24), byte(value >> 16), byte(value >> 8), byte(value)}), nil
}
