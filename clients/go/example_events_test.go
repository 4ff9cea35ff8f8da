package kvsvc_test

import (
	"context"
	"encoding/hex"
	"errors"
	"io"
	"log"
	"time"

	kvsvc "github.com/kvsvc/kvsvc/clients/go"
)

// The README's events follower, complete (compiled by go vet and go test; the
// same calls run against live servers in events_test.go): a local index of one
// namespace fed by WatchEvents, watched again from the kept cursor after a
// break (a resync when the server can no longer serve it).
func ExampleClient_WatchEvents() {
	c, err := kvsvc.New("127.0.0.1:50051", kvsvc.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	index := map[string]bool{} // hex key -> present
	var saved *kvsvc.EventCursor
	for attempt := 0; attempt < 3; attempt++ {
		err := follow(ctx, c, index, &saved)
		var notServing *kvsvc.ServiceNotServing
		if errors.As(err, &notServing) || errors.Is(err, io.EOF) {
			break // go elsewhere / closed
		}
		log.Printf("watching again from %+v after %v", saved, err)
		time.Sleep(time.Second)
	}
}

func follow(ctx context.Context, c *kvsvc.Client, index map[string]bool, saved **kvsvc.EventCursor) error {
	s, err := c.WatchEvents(ctx, kvsvc.WatchOptions{Namespaces: []string{"llama-3-8b/fp16"}, Cursor: *saved})
	if err != nil {
		return err
	}
	defer s.Close()
	for {
		b, err := s.Next()
		if err != nil {
			return err
		}
		if b.Lost {
			for k := range index {
				delete(index, k)
			}
		}
		for _, ev := range b.Events {
			switch {
			case ev.GetStored() != nil:
				for _, k := range ev.GetStored().Keys {
					index[hex.EncodeToString(k)] = true
				}
			case ev.GetRemoved() != nil:
				for _, k := range ev.GetRemoved().Keys {
					delete(index, hex.EncodeToString(k))
				}
			default: // cleared
				for k := range index {
					delete(index, k)
				}
			}
		}
		if cur := s.Cursor(); cur != nil {
			*saved = cur
		}
	}
}
