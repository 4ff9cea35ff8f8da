package kvsvc

// Starts real `kvsvc serve` processes on 127.0.0.1 for the tests and stops them.

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

const startupTimeout = 60 * time.Second

type testServer struct {
	addr   string
	shmDir string
	cmd    *exec.Cmd
	done   chan struct{}
	mu     sync.Mutex
	log    strings.Builder
}

func (s *testServer) Log() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.log.String()
}

// kvsvcBin is $KVSVC_BIN, else ../../.venv/bin/kvsvc; a relative path is taken
// from the client's real directory (the test may run under a GOPATH symlink).
func kvsvcBin() (string, error) {
	bin := os.Getenv("KVSVC_BIN")
	if bin == "" {
		bin = "../../.venv/bin/kvsvc"
	}
	if filepath.IsAbs(bin) {
		return bin, nil
	}
	wd, err := os.Getwd()
	if err != nil {
		return "", err
	}
	if real, err := filepath.EvalSymlinks(wd); err == nil {
		wd = real
	}
	return filepath.Join(wd, bin), nil
}

var servingRE = regexp.MustCompile(`serving on (127\.0\.0\.1:\d+)`)

func launch(failpoints string, args ...string) (*testServer, error) {
	bin, err := kvsvcBin()
	if err != nil {
		return nil, err
	}
	return launchCmd([]string{bin}, failpoints, args...)
}

// withoutSessionCmd runs clients/testdata/kvsvc_without_session.py: the real
// server with no Session RPC (one from before it), with the venv's python
// ($KVSVC_PYTHON, else the python beside the kvsvc executable).
func withoutSessionCmd() ([]string, error) {
	bin, err := kvsvcBin()
	if err != nil {
		return nil, err
	}
	python := os.Getenv("KVSVC_PYTHON")
	if python == "" {
		python = filepath.Join(filepath.Dir(bin), "python")
	}
	wd, err := os.Getwd()
	if err != nil {
		return nil, err
	}
	if real, err := filepath.EvalSymlinks(wd); err == nil {
		wd = real
	}
	return []string{python, filepath.Join(wd, "..", "testdata", "kvsvc_without_session.py")}, nil
}

// launchCmd starts cmdline + "serve ..." (cmdline[0] is the executable).
func launchCmd(cmdline []string, failpoints string, args ...string) (*testServer, error) {
	bin := cmdline[0]
	shm, err := os.MkdirTemp("", "kvsvc-go-shm-")
	if err != nil {
		return nil, err
	}
	argv := append(append(append([]string{}, cmdline[1:]...), "serve", "--listen", "127.0.0.1:0", "--shm-dir", shm,
		"--shutdown-grace", "1", "--device", "cpu"), args...)
	cmd := exec.Command(bin, argv...)
	cmd.Env = append(os.Environ(), "KVSVC_FAILPOINTS="+failpoints)
	// Its own process group (stop kills all of it), and killed by the kernel if
	// this test binary dies first (a panic skips every cleanup).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	// Pdeathsig fires when the thread that started the child exits: keep it a
	// thread the runtime never ends while starting.
	runtime.LockOSThread()
	err = cmd.Start()
	runtime.UnlockOSThread()
	if err != nil {
		os.RemoveAll(shm)
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	s := &testServer{shmDir: shm, cmd: cmd, done: make(chan struct{})}
	addrs := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		found := false
		for sc.Scan() {
			line := sc.Text()
			s.mu.Lock()
			if s.log.Len() < 1<<20 {
				s.log.WriteString(line + "\n")
			}
			s.mu.Unlock()
			if m := servingRE.FindStringSubmatch(line); m != nil && !found {
				found = true
				addrs <- m[1]
			}
		}
		_ = cmd.Wait()
		close(s.done)
	}()
	select {
	case s.addr = <-addrs:
		return s, nil
	case <-s.done:
		os.RemoveAll(shm)
		return nil, fmt.Errorf("kvsvc exited before serving:\n%s", s.Log())
	case <-time.After(startupTimeout):
		s.stop()
		return nil, fmt.Errorf("kvsvc did not start within %v:\n%s", startupTimeout, s.Log())
	}
}

func (s *testServer) stop() {
	pgid := s.cmd.Process.Pid
	_ = syscall.Kill(-pgid, syscall.SIGTERM)
	select {
	case <-s.done:
	case <-time.After(5 * time.Second):
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
		select {
		case <-s.done:
		case <-time.After(5 * time.Second): // stderr held open by a stray child
		}
	}
	_ = syscall.Kill(-pgid, syscall.SIGKILL) // whatever the server left behind
	os.RemoveAll(s.shmDir)
}

// startServer starts a dedicated server that the test's cleanup stops.
func startServer(t *testing.T, failpoints string, args ...string) *testServer {
	t.Helper()
	s, err := launch(failpoints, args...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.stop)
	return s
}

var (
	sharedOnce sync.Once
	shared     *testServer
	sharedErr  error
)

// sharedServer is one plain server for the tests that need no failpoint.
func sharedServer(t *testing.T) *testServer {
	t.Helper()
	sharedOnce.Do(func() { shared, sharedErr = launch("") })
	if sharedErr != nil {
		t.Fatal(sharedErr)
	}
	return shared
}

func TestMain(m *testing.M) {
	code := m.Run()
	if shared != nil {
		shared.stop()
	}
	os.Exit(code)
}

// newClient makes a client for s that the test's cleanup closes.
func newClient(t *testing.T, addr string, opts Options) *Client {
	t.Helper()
	c, err := New(addr, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// refusedAddress is a 127.0.0.1 address on which nothing listens.
func refusedAddress(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// ctxFor bounds a whole test step, so that no test can hang.
func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}
