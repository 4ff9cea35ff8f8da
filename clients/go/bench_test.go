package kvsvc

// Lookup latency at one caller, over the session and over unary calls, against a
// real `kvsvc serve`: go test -run '^$' -bench LookupP50 -benchtime 4000x

import (
	"context"
	"sort"
	"testing"
	"time"
)

// BenchmarkLookupP50 alternates one session Lookup and one unary Lookup (same
// keys, same server, same moment) and reports each one's p50 and p99.
func BenchmarkLookupP50(b *testing.B) {
	sharedOnce.Do(func() { shared, sharedErr = launch("") })
	if sharedErr != nil {
		b.Fatal(sharedErr)
	}
	ctx := context.Background()
	sc, err := New(shared.addr, Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer sc.Close()
	uc, err := New(shared.addr, Options{DisableSession: true})
	if err != nil {
		b.Fatal(err)
	}
	defer uc.Close()
	ns := "bench-" + newRequestID()
	keys := [][]byte{[]byte("k0"), []byte("k1"), []byte("k2"), []byte("k3")}
	if _, err := sc.Store(ctx, ns, []Chunk{{keys[0], make([]byte, 1024)}, {keys[1], make([]byte, 1024)}}); err != nil {
		b.Fatal(err)
	}
	for i := 0; i < 200; i++ { // warm both paths
		if _, err := sc.Lookup(ctx, ns, keys); err != nil {
			b.Fatal(err)
		}
		if _, err := uc.Lookup(ctx, ns, keys); err != nil {
			b.Fatal(err)
		}
	}
	lat := map[string][]time.Duration{}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j, c := range []*Client{sc, uc} {
			if i%2 == 1 { // alternate which goes first
				c = []*Client{uc, sc}[j]
			}
			t0 := time.Now()
			r, err := c.Lookup(ctx, ns, keys)
			d := time.Since(t0)
			if err != nil || r.HitChunks != 2 {
				b.Fatalf("%v %v", r, err)
			}
			mode := "unary"
			if c == sc {
				mode = "session"
			}
			lat[mode] = append(lat[mode], d)
		}
	}
	b.StopTimer()
	for mode, ds := range lat {
		sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
		b.ReportMetric(float64(ds[len(ds)/2].Microseconds()), mode+"-p50-µs")
		b.ReportMetric(float64(ds[len(ds)*99/100].Microseconds()), mode+"-p99-µs")
	}
}
